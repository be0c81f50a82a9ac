"""Cold against warm compile cache, in one run: the pipeline's compile stage, and the first
training step (which loads its graph from the cache, or compiles it on the spot when it is not
there).

    python benchmarks/compile_cache.py [--optlevel 2]

The last line printed is JSON (`_report`'s shape), with {"warm_compiles": 0,
"warm_over_cold_compile_s": ..., "first_step_warm_over_cold": ..., ...}. Goals: no compiles warm,
a warm compile stage under 5% of a cold one.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from _quickstart import quickstart, scratch_home
from _report import emit, ratio_figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optlevel", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--steps", type=int, default=5, help="training steps per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        from prefect import flow

        from trnflow.backends import JobRequest, JobState, wait
        from trnflow.backends.local import LocalBackend
        from trnflow.settings import TrnflowSettings
        from trnflow.tasks.compile import compile_graphs

        def spec(cache: str, run: str):
            return quickstart(root, compile={"optlevel": args.optlevel, "cache_url": str(root / cache)},
                              train={"steps": args.steps, "checkpoint_every": args.steps,
                                     "checkpoint_url": str(root / run)})

        @flow(name="compile-stage-benchmark")
        def compile_stage(spec, run_id: str) -> tuple[Any, float]:
            began = time.perf_counter()
            result = compile_graphs(spec, run_id, [0, 1])
            return result, time.perf_counter() - began

        def first_step(spec, run_id: str) -> float:
            backend = LocalBackend(TrnflowSettings().jobs_dir)
            info = wait(backend, backend.submit(JobRequest(spec, "train", run_id)), 0.1)
            assert info.state is JobState.SUCCEEDED, info.failure
            return info.result.first_step_seconds

        warm_spec = spec("cache", "ckpt-warm")
        cold_result, cold_s = compile_stage(warm_spec, "cold")
        warm_result, warm_s = compile_stage(warm_spec, "warm")
        step_cold = first_step(spec("empty-cache", "ckpt-cold"), "cold")  # compiles its graph on the spot
        step_warm = first_step(warm_spec, "warm")  # loads it from the cache
        print(f"O{args.optlevel} compile stage: cold {cold_s:.1f}s ({cold_result.compiled} compiled), "
              f"warm {warm_s:.2f}s ({warm_result.compiled} compiled)")
        print(f"first training step: empty cache {step_cold:.2f}s, warm cache {step_warm:.2f}s")
        emit("compile_cache", [
            ratio_figure("compile stage, warm cache", [warm_s], [cold_s], unit="s", baseline_name="cold cache",
                         better="lower", goal=0.05),
            ratio_figure("first training step, warm cache", [step_warm], [step_cold], unit="s",
                         baseline_name="empty cache", better="lower"),
        ], **{
            "optlevel": args.optlevel,
            "cold_compile_s": round(cold_s, 3), "warm_compile_s": round(warm_s, 3),
            "warm_compiles": warm_result.compiled,
            "warm_over_cold_compile_s": round(warm_s / cold_s, 4),
            "first_step_cold_s": round(step_cold, 3), "first_step_warm_s": round(step_warm, 3),
            "first_step_warm_over_cold": round(step_warm / step_cold, 4),
        })


if __name__ == "__main__":
    main()
