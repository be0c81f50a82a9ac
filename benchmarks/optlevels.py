"""O1 against O2 on the quickstart model, in one run: what each optlevel costs to compile and
what its training step then costs.

Each optlevel compiles into its own empty cache (the pool of compile.workers processes, as the
compile stage runs it), then trains from that warm cache; the step time is the median over the
steps after the first.

    python benchmarks/optlevels.py [--steps 60]

The last line printed is JSON (`_report`'s shape), with {"o1_over_o2_compile_s": ...,
"o1_over_o2_step_s": ..., ...}.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _quickstart import quickstart, scratch_home
from _report import emit, ratio_figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="training steps per optlevel")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        from trnflow.backends import JobRequest, JobState, wait
        from trnflow.backends.local import LocalBackend
        from trnflow.settings import TrnflowSettings

        backend = LocalBackend(TrnflowSettings().jobs_dir)

        def job(spec, phase: str, processes: int | None = None) -> dict:
            info = wait(backend, backend.submit(JobRequest(spec, phase, f"O{spec.compile.optlevel}",
                                                           processes=processes)), 0.1)
            assert info.state is JobState.SUCCEEDED and info.result is not None, info.failed()
            return info.result.model_dump(mode="json")

        measured = {}
        for optlevel in (1, 2):
            spec = quickstart(root, compile={"optlevel": optlevel, "cache_url": str(root / f"cache-O{optlevel}")},
                              train={"steps": args.steps, "checkpoint_every": args.steps, "log_every": args.steps,
                                     "checkpoint_url": str(root / f"ckpt-O{optlevel}")})
            compiled = job(spec, "compile", processes=1)
            trained = job(spec, "train")
            assert trained["compile"]["recompiles"] == [], trained["compile"]
            measured[optlevel] = {"compile_s": compiled["seconds"], "step_s": trained["median_step_seconds"]}
            print(f"O{optlevel}: compile {compiled['seconds']:.1f}s for {compiled['compiled']} programs, "
                  f"median step {trained['median_step_seconds'] * 1000:.1f} ms")
        o1, o2 = measured[1], measured[2]
        emit("optlevels", [
            ratio_figure("compile seconds, O1", [o1["compile_s"]], [o2["compile_s"]], unit="s", baseline_name="O2",
                         better="lower"),
            ratio_figure("median step, O1", [o1["step_s"]], [o2["step_s"]], unit="s", baseline_name="O2",
                         better="lower"),
        ], **{
            "o1_compile_s": o1["compile_s"], "o2_compile_s": o2["compile_s"],
            "o1_step_s": o1["step_s"], "o2_step_s": o2["step_s"],
            "o1_over_o2_compile_s": round(o1["compile_s"] / o2["compile_s"], 4),
            "o1_over_o2_step_s": round(o1["step_s"] / o2["step_s"], 4),
        })


if __name__ == "__main__":
    main()
