"""The hardware sanity phase: a known-answer matmul on every NeuronCore.

The inputs are small multiples of 1/8, so the exact product is an integer matrix divided by 64,
computed independently in int64. In fp32 the core must reproduce it bit for bit; in bf16 (inputs
exact, products accumulated at higher precision) within a stated relative tolerance.
"""

from __future__ import annotations

import time

import torch

from trnflow.workload.context import WorkerContext, gather_objects

SIZE = 256
TOLERANCE = {torch.float32: 0.0, torch.bfloat16: 1e-2}


def _known_answer(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    a_int = (i * 7 + j * 3 + seed) % 11 - 5
    b_int = (i * 5 + j * 2 + seed) % 13 - 6
    exact = (a_int @ b_int).to(torch.float64) / 64.0
    return a_int.float() / 8.0, b_int.float() / 8.0, exact


def check_matmul(dtype: torch.dtype, seed: int) -> dict:
    a, b, exact = _known_answer(SIZE, seed)
    began = time.perf_counter()
    got = (a.to(dtype) @ b.to(dtype)).to(torch.float64)
    seconds = time.perf_counter() - began
    rel_err = float(((got - exact).abs().max() / exact.abs().max()).item())
    return {
        "test": "matmul",
        "dtype": str(dtype).removeprefix("torch."),
        "max_rel_err": rel_err,
        "tolerance": TOLERANCE[dtype],
        "passed": rel_err <= TOLERANCE[dtype],
        "gflops": round(2 * SIZE**3 / max(seconds, 1e-9) / 1e9, 2),
    }


def run(ctx: WorkerContext) -> dict:
    dtypes = [torch.float32] if ctx.spec.compute.precision == "fp32" else [torch.float32, torch.bfloat16]
    checks = [check_matmul(dtype, seed=ctx.core_id) for dtype in dtypes]
    mine = {"rank": ctx.rank, "core": ctx.core_id, "checks": checks, "passed": all(c["passed"] for c in checks)}
    ctx.log("sanity", core=ctx.core_id, passed=mine["passed"])
    cores = gather_objects(ctx, mine)
    bad = [c["core"] for c in cores if not c["passed"]]
    return {"cores": cores, "bad_cores": bad, "passed": not bad}
