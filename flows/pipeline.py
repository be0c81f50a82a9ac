"""The six-stage training pipeline as one Prefect flow.

sanity -> collectives -> compile -> train -> evaluate (parity gate) -> infer

The flow only composes tasks; where the jobs run is the spec's business. Every stage after
sanity runs on the cores sanity verified.
"""

from __future__ import annotations

from prefect import flow
from prefect.states import State

from trnflow.flows._params import name_run, resolve_spec, window
from trnflow.flows._stages import PipelineFailed, StageRunner, new_run_id, run_stages, through_training
from trnflow.results import RunOutcome
from trnflow.specs import JobSpec
from trnflow.tasks.evaluate import evaluate_gate
from trnflow.tasks.infer import batch_infer

STAGES = ("sanity", "collectives", "compile", "train", "evaluate", "infer")

__all__ = ["STAGES", "PipelineFailed", "pipeline"]


@flow(name="trnflow-pipeline", log_prints=True)
def pipeline(spec: JobSpec | None = None, spec_url: str | None = None,
             run_id: str | None = None) -> RunOutcome | State:
    """Run all six stages for one job spec.

    Args:
        spec: the job spec (validated; the Prefect UI renders it as a form).
        spec_url: where to read the spec instead (a path, file:// or s3:// URL).
        run_id: names this run's checkpoint folder; a rerun with the same id resumes it.

    Returns:
        `run_id`, one summary row per stage, and each stage's full result under `results`.
        A failed gate ends the run in the state `GateFailed`.

    Raises:
        PipelineFailed: at the first failed stage, with the rows of the stages that ran.
    """
    spec = resolve_spec(spec, spec_url)
    name_run(spec, window(spec))
    return run_stages(StageRunner(spec, run_id or new_run_id()), _stages, STAGES)


def _stages(stage: StageRunner) -> RunOutcome:
    cores, trained = through_training(stage, later=("evaluate", "infer"))
    if trained.skipped:  # incremental training found no new data: nothing to evaluate or embed
        return stage.outcome()
    checkpoint = trained.checkpoint
    stage("evaluate", evaluate_gate, checkpoint, cores)
    stage("infer", batch_infer, checkpoint, cores)
    return stage.outcome()
