"""The six-stage training pipeline as one Prefect flow.

sanity -> collectives -> compile -> train -> evaluate (parity gate) -> infer

The flow only composes tasks; where the jobs run is the spec's business. Every stage after
sanity runs on the cores sanity verified.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows._stages import PipelineFailed, StageRunner, new_run_id
from jobspecs import JobSpec
from tasks.collectives import collective_test
from tasks.compile import compile_graphs
from tasks.evaluate import evaluate_gate
from tasks.infer import batch_infer
from tasks.sanity import sanity_check
from tasks.train import train_model

STAGES = ("sanity", "collectives", "compile", "train", "evaluate", "infer")

__all__ = ["STAGES", "PipelineFailed", "pipeline"]


@flow(name="trnflow-pipeline", log_prints=True)
def pipeline(spec: JobSpec, run_id: str | None = None) -> dict[str, Any]:
    """Run all six stages for one job spec.

    Args:
        spec: the job spec (validated; the Prefect UI renders it as a form).
        run_id: names this run's checkpoint folder; a rerun with the same id resumes it.

    Returns:
        `run_id`, one summary row per stage, and each stage's full result under `results`.

    Raises:
        PipelineFailed: at the first failed stage, with the rows of the stages that ran.
    """
    stage = StageRunner(spec, run_id or new_run_id())
    cores = stage("sanity", sanity_check)["cores"]
    stage("collectives", collective_test, cores)
    stage("compile", compile_graphs, cores)
    trained = stage("train", train_model, cores)
    if trained.get("skipped"):  # incremental training found no new data: nothing to evaluate or embed
        for later in ("evaluate", "infer"):
            stage.skip(later, "no new model: training was skipped")
        return stage.outcome()
    checkpoint = trained["checkpoint"]
    stage("evaluate", evaluate_gate, checkpoint, cores)
    stage("infer", batch_infer, checkpoint, cores)
    return stage.outcome()
