"""The training pipeline's six stages, then promotion, as one Prefect flow.

sanity -> collectives -> compile -> train -> [reference] -> evaluate (parity gate, champion's
protection; registers) -> infer (into the new version's own output folder) -> promote (the champion
and the published outputs move together). With `gate.reference: auto`, the reference stage finds the
fp32 reference of the spec and its data on record, or trains it.

The flow only composes tasks; where the jobs run is the spec's business. Every stage after
sanity runs on the cores sanity verified.
"""

from __future__ import annotations

from functools import partial

from prefect import flow
from prefect.states import State

from trnflow.flows._lock import ModelLock, holder_label, model_lock, team_model
from trnflow.flows._params import SpecParam, ends_with_reason, first_name, name_run, pipeline_name, resolve_spec
from trnflow.flows._stages import (
    PIPELINE_STAGES,
    PipelineFailed,
    StageRunner,
    flow_run_id,
    run_stages,
    through_training,
)
from trnflow.results import ReferenceResult, RunOutcome
from trnflow.tasks.evaluate import evaluate_gate
from trnflow.tasks.infer import batch_infer
from trnflow.tasks.promote import promote_champion, repair_publication
from trnflow.tasks.reference import fp32_reference

STAGES = PIPELINE_STAGES
WITH_REFERENCE = (*STAGES[:4], "reference", *STAGES[4:])
"""The stages of a run whose spec asks for its reference automatically (`gate.reference: auto`)."""

__all__ = ["STAGES", "PipelineFailed", "pipeline"]


@flow(name="trnflow-pipeline", flow_run_name=first_name("pipeline"), log_prints=True,
      validate_parameters=False)
@ends_with_reason
def pipeline(spec: SpecParam = None, spec_url: str | None = None,
             run_id: str | None = None, force_promote: str | None = None,
             lock_timeout_seconds: float | None = 3600.0, override_forecast: str | None = None
             ) -> RunOutcome | State:
    """Run all six stages for one job spec.

    Args:
        spec: the job spec, which the Prefect UI renders as a form (a deployment's opens filled with
            its own); a value it refuses fails the run, naming the field.
        spec_url: where to read the spec instead (a path, file:// or s3:// URL).
        run_id: names this run's checkpoint folder; a rerun with the same id resumes it.
        force_promote: why to promote the candidate even if it is worse than the champion (it
            must still pass the gate); recorded in the registry.
        override_forecast: why to launch a run forecast to miss train.max_minutes or a budget
            (`compute.max_cost_usd`, `train.max_cost_usd`), which is otherwise refused before its
            first job; said in its log and summary. The budget still stops training while it runs.
        lock_timeout_seconds: how long to wait while another run of the same model (a pipeline or
            a retraining) holds it before this run is refused; none waits as long as it takes.

    Returns:
        `run_id`, one summary row per stage, and each stage's full result under `results`.
        A failed gate ends the run in the state `GateFailed`; a candidate that passed it but is
        worse than the champion is registered, not promoted, and ends it in `ChampionKept`.

    A failed stage, or a check that stopped the run before its first job, ends it Failed with the
    reason in one line as its state message; the state's data is the `PipelineFailed` (the failed
    stage, its error and the rows of the stages that ran) or the check's error.
    """
    spec = resolve_spec(spec, spec_url)
    name_run(spec, pipeline_name(spec))
    runner = StageRunner(spec, run_id or flow_run_id())
    stages = WITH_REFERENCE if spec.gate.reference == "auto" else STAGES
    if spec.registry_url is None:  # nothing shared to protect: runs of the spec may overlap
        return run_stages(runner, partial(_stages, force_promote=force_promote, lock=None), stages,
                          override_forecast)
    with model_lock(team_model(spec, runner.team), lock_timeout_seconds, holder_label(runner.run_id)) as lock:
        repair_publication(spec)
        return run_stages(runner, partial(_stages, force_promote=force_promote, lock=lock), stages,
                          override_forecast)


def _stages(stage: StageRunner, force_promote: str | None, lock: ModelLock | None) -> RunOutcome:
    auto = stage.spec.gate.reference == "auto"
    cores, trained = through_training(stage, later=(*(("reference",) if auto else ()), "evaluate", "infer", "promote"))
    if trained.skipped:  # incremental training found no new data: nothing to evaluate or embed
        return stage.outcome()
    reference = None
    if auto:  # the fp32 reference of this spec and data: on record, or trained now (within the run's budget)
        found = stage("reference", fp32_reference, cores, stage.budget_left(), team=stage.team)
        assert isinstance(found, ReferenceResult)
        reference = found.url
    gated = stage("evaluate", evaluate_gate, trained.checkpoint, cores, promote=False, force_promote=force_promote,
                  team=stage.team, reference=reference)
    entry = gated.registry
    if lock is None or entry is None:
        stage("infer", batch_infer, trained.checkpoint, cores, team=stage.team)
        stage.skip("promote", "no registry_url: nothing to promote")
        return stage.outcome()
    # the registered version's model: a rerun on the same inputs uses the first run's
    stage("infer", batch_infer, entry.checkpoint, cores, version=entry.version, team=stage.team)
    lock.check()  # promotion is what must never happen outside the model's lock
    stage("promote", promote_champion, entry.version, entry.generation,
          forced=force_promote if entry.forced else None)
    return stage.outcome()
