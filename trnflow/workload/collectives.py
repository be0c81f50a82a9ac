"""The collective-test phase, in the style of nccom-test: time each op over a size sweep,
check every result, and report algorithm and bus bandwidth.

algbw = bytes / time in GiB/s (1 GiB = 2**30 B), as nccom-test prints it; busbw scales algbw by the
op's traffic factor: all-reduce 2(r-1)/r, all-gather and reduce-scatter (r-1)/r.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from trnflow.errors import FatalError
from trnflow.workload.context import WorkerContext

GIB = 1024**3
SIZES = [64 * 1024, 1024 * 1024, 4 * 1024 * 1024]
ITERS, WARMUP = 5, 1


def bus_factor(op: str, ranks: int) -> float:
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return (ranks - 1) / ranks


def _all_reduce(ctx: WorkerContext, count: int) -> tuple[Callable[[], None], Callable[[], bool]]:
    buf = torch.empty(count, dtype=torch.float32)
    expected = ctx.world_size * (ctx.world_size + 1) / 2

    def op() -> None:
        buf.fill_(ctx.rank + 1)
        dist.all_reduce(buf)

    return op, lambda: bool((buf == expected).all())


def run(ctx: WorkerContext) -> dict:
    if ctx.world_size < 2:
        return {"rows": [], "avg_busbw": None, "passed": True, "note": "one core: no collectives to test"}
    rows = []
    for size in SIZES:
        op, check = _all_reduce(ctx, size // 4)
        for _ in range(WARMUP):
            op()
        dist.barrier()
        began = time.perf_counter()
        for _ in range(ITERS):
            op()
        seconds = (time.perf_counter() - began) / ITERS
        ok = torch.tensor([1 if check() else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        algbw = size / seconds / GIB
        rows.append({
            "op": "all_reduce", "size(B)": size, "count(elems)": size // 4, "type": "fp32",
            "time(us)": round(seconds * 1e6, 1), "algbw(GB/s)": round(algbw, 4),
            "busbw(GB/s)": round(algbw * bus_factor("all_reduce", ctx.world_size), 4),
            "correct": bool(ok.item()),
        })
    if not all(r["correct"] for r in rows):
        raise FatalError("all_reduce returned wrong values; a core or link is faulty, run preflight to find it")
    avg = sum(r["busbw(GB/s)"] for r in rows) / len(rows)
    ctx.log("collectives", ranks=ctx.world_size, avg_busbw=round(avg, 4))
    return {"ranks": ctx.world_size, "rows": rows, "avg_busbw": round(avg, 4), "passed": True}
