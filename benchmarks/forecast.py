"""How far a forecast is from what the run then takes. For each layout (instance type and cores), pipeline
runs of the quickstart at the first step counts make the model's history; the forecast of a run at
the last step count is made from them (`trnflow plan`'s, `history` source), then that run is made.
Per stage that took a second or more, the error is |forecast - actual| / actual.

    python benchmarks/forecast.py [--layouts trn1.2xlarge:1 trn1.2xlarge:2 trn1.32xlarge:2] [--steps 20 40 80]

The last line printed is JSON (`_report`'s shape): the error of every stage of every case, and of
training alone, against the goal of 20% (met by the median; the worst is in the details).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, scratch_home
from _report import emit, limit_figure

GOAL = 0.2
SHORTEST = 1.0
"""Stages that took less (seconds) are left out of the relative error: a tenth of a second is noise."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", nargs="+", default=["trn1.2xlarge:1", "trn1.2xlarge:2", "trn1.32xlarge:2"],
                        help="instance type and cores of each layout, TYPE:CORES")
    parser.add_argument("--steps", type=int, nargs="+", default=[20, 40, 80],
                        help="step counts: all but the last make the history, the last is forecast")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        from trnflow.flows.pipeline import pipeline
        from trnflow.reporting.forecast import plan
        from trnflow.reporting.history import history
        from trnflow.settings import TrnflowSettings
        from trnflow.workload.memory import decided

        home = TrnflowSettings().home.expanduser().resolve()
        errors: dict[str, list[float]] = {}
        cases = []
        for layout in args.layouts:
            itype, _, count = layout.partition(":")
            cores = int(count)
            for steps in args.steps:  # one model: a layout's forecast rests on its own runs
                compute = {"instance_type": itype, "cores_per_node": cores}
                spec = decided(quickstart(root, name="forecast", compute=compute,
                                          compile={"cache_url": str(root / "compile-cache")},
                                          train={"steps": steps, "global_batch_size": 16 * cores,
                                                 "checkpoint_every": steps, "log_every": 10}))
                forecast = plan(spec, history(spec, home)[0]) if steps == args.steps[-1] else None
                outcome = pipeline(spec, run_id=f"{itype.replace('.', '-')}-c{cores}-s{steps}",
                                   force_promote="the benchmark measures it")
                if forecast is None:
                    continue
                actual = {row.stage: row.seconds for row in outcome.stages if row.state == "Completed"}
                case = {"instance_type": itype, "cores": cores, "steps": steps, "stages": {}}
                for stage in forecast.stages:
                    if actual.get(stage.stage, 0.0) < SHORTEST:
                        continue
                    took = actual[stage.stage]
                    error = abs(stage.seconds - took) / took
                    errors.setdefault(stage.stage, []).append(error)
                    case["stages"][stage.stage] = {"forecast_s": stage.seconds, "actual_s": round(took, 2),
                                                   "error": round(error, 3), "source": stage.source}
                    print(f"{itype}, {cores} core(s), {steps} steps, {stage.stage}: forecast {stage.seconds:.1f} s "
                          f"({stage.source}), took {took:.1f} s, error {error:.0%}", flush=True)
                cases.append(case)
        every = [e for values in errors.values() for e in values]
        emit("forecast", [
            limit_figure("forecast error, every stage", every, GOAL, unit="share of actual"),
            limit_figure("forecast error, training", errors.get("train", [0.0]), GOAL, unit="share of actual"),
        ], cases=cases, median_error=round(statistics.median(every), 3), worst_error=round(max(every), 3),
             by_stage={stage: {"median": round(statistics.median(v), 3), "worst": round(max(v), 3)}
                       for stage, v in errors.items()})


if __name__ == "__main__":
    main()
