"""The hardware sanity phase: known-answer tests of each NeuronCore engine, on every core.

A NeuronCore has four compute engines and its memory; each gets tests whose answers are known
independently of the core under test:

- tensor engine: a matmul of small multiples of 1/8, whose exact product comes from int64 maths
  (fp32 must match bit for bit);
- vector engine: layernorm and reductions, against float64 on the host;
- scalar engine: elementwise activations (exp, tanh, sigmoid, gelu), against float64;
- GPSIMD engine: a custom operator (an integer segmented prefix sum), against a plain Python loop;
- memory: write-and-read-back patterns (0x55.., 0xAA.., walking ones, address as data).

Each runs in fp32, and also in bf16 when the spec trains in bf16. Tolerances are stated per test.

With a job spec (a pipeline's preflight), the same ranks then sweep the collectives between their
cores once every core has passed, so that preflight costs one job, not two; the collectives stage
takes that sweep (`collectives` in the result) and launches nothing. Last, a checkpoint of the
spec's model is written where the run's checkpoints go, laid out as the run's (whole by rank 0, or
a shard by each rank), read back and deleted (`roundtrip`, `checkpoint` in the result), unless
`preflight.checkpoint_round_trip` is off.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from trnflow.device.base import FaultHooks, NoFaults
from trnflow.measures import CoreChecks, EngineCheck, HostInventory
from trnflow.neuron import tools, topology
from trnflow.workload import collectives
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.roundtrip import round_trip

MATMUL_SIZE = 256
MEMORY_WORDS = 1024 * 1024  # 4 MiB of int32 per pattern
# (engine, dtype) -> largest allowed relative error against the host reference
TOLERANCE = {
    ("tensor", torch.float32): 0.0,
    ("tensor", torch.bfloat16): 1e-2,
    ("vector", torch.float32): 1e-5,
    ("vector", torch.bfloat16): 3e-2,
    ("scalar", torch.float32): 1e-5,
    ("scalar", torch.bfloat16): 3e-2,
}


def _known_matmul(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    a_int = (i * 7 + j * 3 + seed) % 11 - 5
    b_int = (i * 5 + j * 2 + seed) % 13 - 6
    exact = (a_int @ b_int).to(torch.float64) / 64.0
    return a_int.float() / 8.0, b_int.float() / 8.0, exact


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())


def _record(engine: str, test: str, dtype: torch.dtype, err: float, seconds: float, **extra: Any) -> EngineCheck:
    tol = TOLERANCE[(engine, dtype)]
    return EngineCheck(engine=engine, test=test, dtype=str(dtype).removeprefix("torch."), max_rel_err=err,
                       tolerance=tol, passed=err <= tol, us=round(seconds * 1e6, 1), **extra)


def check_matmul(dtype: torch.dtype, seed: int, faults: FaultHooks | None = None) -> EngineCheck:
    faults = faults or NoFaults()
    a, b, exact = _known_matmul(MATMUL_SIZE, seed)
    began = time.perf_counter()
    got = faults.corrupt(a.to(dtype) @ b.to(dtype))
    seconds = time.perf_counter() - began
    return _record("tensor", "matmul", dtype, _rel_err(got, exact), seconds,
                   gflops=round(2 * MATMUL_SIZE**3 / max(seconds, 1e-9) / 1e9, 2))


def _vector_checks(dtype: torch.dtype, seed: int, faults: FaultHooks) -> list[EngineCheck]:
    gen = torch.Generator().manual_seed(seed)
    x64 = torch.randn(64, 512, generator=gen, dtype=torch.float64)
    x = x64.to(dtype)
    ref_in = x.double()  # the reference sees exactly the values the core sees
    mean = ref_in.mean(-1, keepdim=True)
    var = ref_in.var(-1, unbiased=False, keepdim=True)
    tests: list[tuple[str, Callable[[], torch.Tensor], torch.Tensor]] = [
        ("layernorm", lambda: F.layer_norm(x, (512,), eps=1e-5), (ref_in - mean) / torch.sqrt(var + 1e-5)),
        ("sum", lambda: x.float().sum(-1) if dtype == torch.bfloat16 else x.sum(-1), ref_in.sum(-1)),
        ("max", lambda: x.amax(-1), ref_in.amax(-1)),
    ]
    out = []
    for name, fn, want in tests:
        began = time.perf_counter()
        got = faults.corrupt(fn())
        out.append(_record("vector", name, dtype, _rel_err(got, want), time.perf_counter() - began))
    return out


def _scalar_checks(dtype: torch.dtype, faults: FaultHooks) -> list[EngineCheck]:
    x = torch.linspace(-6, 6, 4099, dtype=torch.float64).to(dtype)
    ref_in = x.double()
    gelu_ref = 0.5 * ref_in * (1 + torch.erf(ref_in / math.sqrt(2)))
    tests = [("exp", torch.exp, torch.exp(ref_in)), ("tanh", torch.tanh, torch.tanh(ref_in)),
             ("sigmoid", torch.sigmoid, torch.sigmoid(ref_in)), ("gelu", F.gelu, gelu_ref)]
    out = []
    for name, fn, want in tests:
        began = time.perf_counter()
        got = faults.corrupt(fn(x))
        out.append(_record("scalar", name, dtype, _rel_err(got, want), time.perf_counter() - began))
    return out


def _segmented_prefix_sum(values: torch.Tensor, segment: int) -> torch.Tensor:
    return values.view(-1, segment).cumsum(-1).view(-1)


# A GPSIMD-style custom operator, `torch.ops.trnflow.segmented_prefix_sum`: inclusive prefix sums
# restarting every `segment` elements. Registered with a schema and a CPU kernel through
# torch.library.Library rather than the `custom_op` decorator, whose first call imports
# TorchDynamo (over a second of start-up in every sanity worker).
_OPS = torch.library.Library("trnflow", "DEF")
_OPS.define("segmented_prefix_sum(Tensor values, int segment) -> Tensor")
_OPS.impl("segmented_prefix_sum", _segmented_prefix_sum, "CPU")
segmented_prefix_sum = torch.ops.trnflow.segmented_prefix_sum


def _gpsimd_check(seed: int, faults: FaultHooks) -> EngineCheck:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1000, 1000, (8192,), generator=gen, dtype=torch.int64)
    began = time.perf_counter()
    got = faults.corrupt(segmented_prefix_sum(values, 64).double())
    seconds = time.perf_counter() - began
    want, running = [], 0
    for idx, v in enumerate(values.tolist()):
        running = v if idx % 64 == 0 else running + v
        want.append(running)
    mismatches = int((got != torch.tensor(want, dtype=torch.float64)).sum())
    return EngineCheck(engine="gpsimd", test="segmented_prefix_sum", dtype="int64", mismatches=mismatches,
                       tolerance=0, passed=mismatches == 0, us=round(seconds * 1e6, 1))


def _memory_check(faults: FaultHooks) -> EngineCheck:
    buf = torch.empty(MEMORY_WORDS, dtype=torch.int32)
    patterns = {"0x55555555": 0x55555555, "0xAAAAAAAA": -0x55555556}
    bad, began = 0, time.perf_counter()
    for value in patterns.values():
        buf.fill_(value)
        faults.flip_bits(buf)
        bad += int((buf != value).sum())
    for bit in range(0, 31, 5):  # walking ones
        buf.fill_(1 << bit)
        faults.flip_bits(buf)
        bad += int((buf != (1 << bit)).sum())
    torch.arange(MEMORY_WORDS, dtype=torch.int32, out=buf)  # address as data
    faults.flip_bits(buf)
    bad += int((buf != torch.arange(MEMORY_WORDS, dtype=torch.int32)).sum())
    return EngineCheck(engine="memory", test="patterns", dtype="int32", bytes=MEMORY_WORDS * 4, mismatches=bad,
                       tolerance=0, passed=bad == 0, us=round((time.perf_counter() - began) * 1e6, 1))


def core_checks(core: int, precision: str, faults: FaultHooks) -> list[EngineCheck]:
    """Every known-answer test of one core."""
    dtypes = [torch.float32] if precision == "fp32" else [torch.float32, torch.bfloat16]
    checks = []
    for dtype in dtypes:
        checks.append(check_matmul(dtype, seed=core, faults=faults))
        checks += _vector_checks(dtype, core, faults)
        checks += _scalar_checks(dtype, faults)
    checks.append(_gpsimd_check(core, faults))
    checks.append(_memory_check(faults))
    return checks


def host_inventory(ctx: WorkerContext, per_core: list[CoreChecks]) -> HostInventory | None:
    """The host's device list against the job's cores: from `neuron-ls --json-output` when it is on
    PATH (a Neuron host), else the emulated instance's (with a spec). A core the list lacks is bad;
    one another process holds is named."""
    cores = sorted(c.core for c in per_core)
    if tools.which(tools.NEURON_LS):
        records, source = tools.neuron_ls(), tools.NEURON_LS
    elif ctx.spec is not None:
        records, source = topology.neuron_ls(ctx.spec.compute.instance_type), "emulator"
    else:
        return None
    return tools.inventory(records, cores, {c.pid for c in per_core if c.pid is not None}, source)


def run(ctx: WorkerContext, run_id: str = "adhoc") -> dict:
    precision = ctx.spec.compute.precision if ctx.spec else "fp32"
    checks = core_checks(ctx.core_id, precision, ctx.faults)
    failed = [c.name for c in checks if not c.passed]
    mine = CoreChecks(rank=ctx.rank, core=ctx.core_id, pid=os.getpid(), checks=checks, passed=not failed,
                      failed=failed)
    ctx.log("sanity", all_ranks=True, core=ctx.core_id, passed=mine.passed, failed=failed)
    # Gathering the results is also a liveness check: a core that stalls in collectives is named here.
    per_core = ctx.collective("gathering sanity results", lambda: gather_objects(ctx, mine))
    found = host_inventory(ctx, per_core) if ctx.is_main else None
    bad = sorted({c.core for c in per_core if not c.passed} | set(found.missing if found else []))
    if found and found.missing:
        ctx.log("sanity", missing=found.missing, source=found.source)
    result = {"per_core": per_core, "bad_cores": bad, "passed": not bad, "inventory": found}
    if ctx.spec is None:
        return result
    # Only rank 0 read the host's device list: the ranks agree on the verdict before going on together.
    healthy = not bad
    if ctx.world_size > 1:
        healthy = ctx.collective("agreeing on the sanity verdict", lambda: collectives.all_true(not bad))
    # Wrong results are reported, not raised: they are the collectives stage's to fail on.
    result["collectives"] = collectives.sweep(ctx, {}, report_wrong=True) if healthy else None
    if ctx.spec.preflight.checkpoint_round_trip and healthy:
        trip = round_trip(ctx, run_id)  # on every rank: a sharded run's ranks each write a shard
        result["checkpoint"] = trip.model_dump(mode="json") if trip else None
    return result
