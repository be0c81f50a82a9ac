"""The collective-test phase, in the style of nccom-test: time each op over a size sweep, check
every result, and report algorithm and bus bandwidth.

size(B) is the whole buffer an op produces or consumes (the reduced, gathered or scattered
tensor). algbw = size / time in GiB/s (1 GiB = 2**30 B), as nccom-test prints it; busbw scales
algbw by the op's traffic factor: all-reduce 2(r-1)/r, all-gather, reduce-scatter and
all-to-all (r-1)/r.

A rank that stops answering is cut off by the process group's timeout; its peers then name it
from the progress records every rank leaves before each op.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trnflow.errors import FatalError
from trnflow.measures import PlanSummary, SweepRow
from trnflow.neuron import plan, tools
from trnflow.neuron.launch import INSTANCE_TYPE_ENV
from trnflow.neuron.nccom import OPS, bus_factor
from trnflow.workload.context import WorkerContext

GIB = 1024**3
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULTS = {"ops": ["all_reduce"], "minbytes": 64 * 1024, "maxbytes": 4 * 1024 * 1024, "stepfactor": 4,
            "iters": 5, "warmup": 1, "dtype": "fp32", "check": True}


class CorruptCollective(FatalError):
    """A collective returned wrong values."""


def sweep_sizes(minbytes: int, maxbytes: int, stepfactor: int) -> list[int]:
    sizes, size = [], minbytes
    while size <= maxbytes:
        sizes.append(size)
        if stepfactor <= 1:
            break
        size *= stepfactor
    return sizes


_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Case:
    prepare: Callable[[], None]
    """Fill this rank's input (outside the timed loop, as nccom-test does)."""
    run: Callable[[], None]
    """The collective alone: what is timed."""
    sent_ok: Callable[[], bool]
    """Whether what this rank sent is what it meant to send (its own engines did not corrupt it)."""
    result_ok: Callable[[], bool]


def _pattern(n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """What a rank contributes to a reduction: small integers, different per position and between
    neighbouring ranks. Each is at most 3, so every partial sum over up to 64 ranks stays below
    256 and is exact in bf16 too."""
    return (torch.arange(n) % 2 + rank % 2 + 1).to(dtype)


def _distinct(n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """What a rank contributes to a gather: different for every rank (exact in bf16 up to 249 ranks)."""
    return (torch.arange(n) % 7 + rank + 1).to(dtype)


def _case(ctx: WorkerContext, op: str, count: int, dtype: torch.dtype) -> Case:
    r, w = ctx.rank, ctx.world_size
    corrupt = ctx.faults.corrupt
    chunk = count // w
    if op == "all_reduce":
        buf = torch.empty(count, dtype=dtype)
        sent = torch.empty(count, dtype=dtype)
        expected = (w * (torch.arange(count) % 2) + sum(k % 2 + 1 for k in range(w))).to(dtype)

        def prepare() -> None:
            sent.copy_(corrupt(_pattern(count, r, dtype)))
            buf.copy_(sent)

        return Case(prepare, lambda: dist.all_reduce(buf), lambda: torch.equal(sent, _pattern(count, r, dtype)),
                    lambda: torch.equal(buf, expected))
    if op == "all_gather":
        out = torch.empty(chunk * w, dtype=dtype)
        mine = torch.empty(chunk, dtype=dtype)
        expected = torch.cat([_distinct(chunk, k, dtype) for k in range(w)])
        return Case(lambda: mine.copy_(corrupt(_distinct(chunk, r, dtype))), lambda: _gather(out, mine),
                    lambda: torch.equal(mine, _distinct(chunk, r, dtype)), lambda: torch.equal(out, expected))
    if op == "reduce_scatter":
        inp = torch.empty(chunk * w, dtype=dtype)
        out = torch.empty(chunk, dtype=dtype)
        total = sum(_pattern(chunk * w, k, dtype).double() for k in range(w)).to(dtype)
        expected = total[r * chunk:(r + 1) * chunk]
        return Case(lambda: inp.copy_(corrupt(_pattern(chunk * w, r, dtype))), lambda: _scatter(out, inp),
                    lambda: torch.equal(inp, _pattern(chunk * w, r, dtype)), lambda: torch.equal(out, expected))
    # all_to_all: rank r sends block k (holding r*w + k) to rank k
    inp = torch.empty(chunk * w, dtype=dtype)
    out = torch.empty(chunk * w, dtype=dtype)
    intended = torch.arange(w).repeat_interleave(chunk).add(r * w).to(dtype)
    expected = (torch.arange(w) * w + r).repeat_interleave(chunk).to(dtype)
    return Case(lambda: inp.copy_(corrupt(intended)), lambda: dist.all_to_all_single(out, inp),
                lambda: torch.equal(inp, intended), lambda: torch.equal(out, expected))


def all_true(flag: bool) -> bool:
    """Whether `flag` holds on every rank (on every rank)."""
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _measure(ctx: WorkerContext, op: str, size: int, dtype_name: str, iters: int, warmup: int,
             check: bool) -> SweepRow:
    dtype = DTYPES[dtype_name]
    elem = torch.tensor([], dtype=dtype).element_size()
    count = max(ctx.world_size, size // elem // ctx.world_size * ctx.world_size)
    case = _case(ctx, op, count, dtype)
    case.prepare()
    for _ in range(warmup):
        case.run()
    dist.barrier()
    began = time.perf_counter()
    for _ in range(iters):
        case.run()
    took = torch.tensor([(time.perf_counter() - began) / iters])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the op is as slow as its slowest rank
    seconds = float(took.item())
    size_bytes = count * elem
    algbw = size_bytes / seconds / GIB
    row = SweepRow(op=op, size=size_bytes, count=count, type=dtype_name, time_us=round(seconds * 1e6, 1),
                   algbw=round(algbw, 4), busbw=round(algbw * bus_factor(op, ctx.world_size), 4))
    if check:  # one more, from fresh inputs, whose result is checked
        case.prepare()
        case.run()
        row.correct = all_true(case.result_ok())
        if not row.correct:
            sent_ok = [None] * ctx.world_size
            dist.all_gather_object(sent_ok, (ctx.core_id, case.sent_ok()))
            row.bad_cores = sorted(core for core, ok in sent_ok if not ok)
    return row


def run(ctx: WorkerContext) -> dict:
    return sweep(ctx, ctx.options)


def sweep(ctx: WorkerContext, options: dict, report_wrong: bool = False) -> dict:
    """The sweep `options` ask for (DEFAULTS fill the rest). Wrong results raise CorruptCollective,
    or with `report_wrong` come back as the result (`passed` false, the bad cores and why in
    `note`): how the sanity job, which runs the sweep after its own checks, hands them on to the
    collectives stage."""
    opts = {**DEFAULTS, **options}
    ops = list(OPS) if opts["ops"] in ("all", ["all"]) else list(opts["ops"])
    if ctx.world_size < 2:
        return {"ranks": 1, "rows": [], "avg_busbw": None, "passed": True, "bad_cores": [],
                "note": "one core: no collectives to test"}
    if opts["dtype"] not in DTYPES:
        raise FatalError(f"collective dtype {opts['dtype']!r}: choose one of {', '.join(DTYPES)}")
    sizes = sweep_sizes(int(opts["minbytes"]), int(opts["maxbytes"]), int(opts["stepfactor"]))
    if tools.which(tools.NCCOM_TEST):
        return _with_nccom_test(ctx, ops, sizes, opts, report_wrong)
    rows = []
    for op in ops:
        for size in sizes:
            rows.append(ctx.collective(
                f"{op} of {size} B",
                lambda op=op, size=size: _measure(ctx, op, size, opts["dtype"], int(opts["iters"]),
                                                  int(opts["warmup"]), bool(opts["check"]))))
            ctx.log("collective", **rows[-1].model_dump(exclude_defaults=True))
    return _summarise(ctx, ops, sizes, rows, "trnflow", report_wrong)


def _with_nccom_test(ctx: WorkerContext, ops: list[str], sizes: list[int], opts: dict, report_wrong: bool) -> dict:
    """On a Neuron host: the SDK's nccom-test sweeps the job's cores, started once by rank 0 while
    the other ranks wait; its rows are the result."""
    rows: list[SweepRow] = []
    if ctx.is_main:
        for op in ops:
            swept = tools.nccom_sweep(op, ctx.world_size, sizes[0], sizes[-1], int(opts["stepfactor"]),
                                      opts["dtype"], int(opts["iters"]), int(opts["warmup"]), bool(opts["check"]))
            for row in swept:
                ctx.log("collective", **row.model_dump(exclude_defaults=True))
            rows += swept
    ctx.collective("waiting for nccom-test", dist.barrier)
    if not ctx.is_main:  # rank 0 reports
        return {"ranks": ctx.world_size, "rows": [], "avg_busbw": None, "source": tools.NCCOM_TEST}
    return _summarise(ctx, ops, sizes, rows, tools.NCCOM_TEST, report_wrong)


def _summarise(ctx: WorkerContext, ops: list[str], sizes: list[int], rows: list[SweepRow], source: str,
               report_wrong: bool = False) -> dict:
    bad = sorted({c for row in rows for c in row.bad_cores})
    if any(row.correct is False for row in rows):
        failing = [f"{row.op} {row.size}B" for row in rows if row.correct is False]
        names = f"core(s) {bad} sent corrupted data" if bad else "the cause is not on a single core"
        why = f"wrong results from {', '.join(failing[:4])}: {names}; run preflight"
        if not report_wrong:
            raise CorruptCollective(why, bad_cores=bad)
        return {"ranks": ctx.world_size, "rows": rows, "avg_busbw": None, "passed": False, "bad_cores": bad,
                "note": why, "source": source}
    per_op = {op: [r.busbw for r in rows if r.op == op] for op in ops}
    by_op = {op: round(sum(b) / len(b), 4) for op, b in per_op.items() if b}
    avg = round(sum(r.busbw for r in rows) / len(rows), 4)
    return {"ranks": ctx.world_size, "rows": rows, "avg_busbw": avg, "avg_busbw_by_op": by_op,
            "passed": True, "bad_cores": [], "source": source, "plans": _plans(ctx, ops, sizes[-1])}


def _plans(ctx: WorkerContext, ops: list[str], size: int) -> list[PlanSummary]:
    """What the ring and tree forms of each swept op cost over this job's cores at the sweep's
    largest size: steps, steps that cross nodes, bytes each rank sends. None where the instance
    type is unknown (a worker started by hand)."""
    spec = ctx.spec
    itype = spec.compute.instance_type if spec is not None else os.environ.get(INSTANCE_TYPE_ENV)
    if itype is None:
        return []
    whole = spec is not None and spec.compute.nodes * spec.compute.cores_per_node == ctx.world_size
    nodes = spec.compute.nodes if whole else 1
    topology = plan.build_topology(itype, nodes, ctx.world_size // nodes)
    planned = tuple(op for op in ops if op in plan.OPS)
    return plan.summaries(topology, size, ops=planned)
