"""Scheduled incremental retraining: train the champion further on the days that arrived since
its watermark, gate the result, embed with it (into its version's own output folder), and only
then make it the champion and publish its outputs.

    nothing new since the champion's watermark -> Completed("nothing new"), no job launched
    else: sanity -> collectives -> compile -> train (from the champion) -> evaluate (against the
          champion, and gate.reference when that is a file) -> infer (into the version's own
          output folder) -> promote (and point `current` at that folder)

One run per model at a time (`trnflow.flows._lock`). Promotion is the last step, so a run that fails
anywhere leaves the champion, the watermark that comes with it, and the published embeddings
unchanged: the next scheduled run retries the same window. Outputs whose publication was cut
short after their model was promoted are published by the next run, before anything else.
"""

from __future__ import annotations

from functools import partial

from prefect import flow, get_run_logger
from prefect.states import Completed, State

from trnflow.flows._lock import ModelLock, holder_label, model_lock, team_model
from trnflow.flows._params import SpecParam, ends_with_reason, first_name, name_run, resolve_spec
from trnflow.flows._stages import PIPELINE_STAGES, StageRunner, flow_run_id, run_stages, through_training
from trnflow.lifecycle.registry import Registry
from trnflow.results import RunOutcome
from trnflow.specs import RETRAINED, JobSpec, SpecError, apply_overrides, validate_spec
from trnflow.storage.datafiles import check_new_days, new_partitions
from trnflow.tasks.evaluate import evaluate_gate
from trnflow.tasks.infer import batch_infer
from trnflow.tasks.promote import promote_champion, repair_publication
from trnflow.workload.recipes import RECIPES

STAGES = PIPELINE_STAGES


def retrain_spec(spec: JobSpec) -> JobSpec:
    """The spec as retraining runs it: from the champion, on the partitions after its watermark."""
    if spec.registry_url is None:
        raise SpecError(spec.name, ["registry_url: incremental retraining keeps its champion and watermark in a "
                                    "model registry; set registry_url"])
    current = {"train.init_from": spec.train.init_from, "data.window": spec.data.window}
    changes = [f"{field}: {value}" for field, value in RETRAINED.items() if current[field] != value]
    if changes:
        get_run_logger().info("retraining runs the spec with %s", " and ".join(changes))
    # starting from the champion puts the registry in the jobs' reach: validated whole again
    return validate_spec(apply_overrides(spec.model_dump(mode="json"), RETRAINED), spec.name, RECIPES)


@flow(name="trnflow-incremental-retrain", flow_run_name=first_name("retrain"), log_prints=True,
      validate_parameters=False)
@ends_with_reason
def incremental_retrain(spec: SpecParam = None, spec_url: str | None = None, run_id: str | None = None,
                        lock_timeout_seconds: float | None = 3600.0, force_promote: str | None = None,
                        override_forecast: str | None = None) -> RunOutcome | State:
    """Retrain the champion on the new days of data, if there are any.

    Args:
        spec: the job spec, which the Prefect UI renders as a form (a deployment's opens filled with
            its own); a value it refuses fails the run, naming the field.
        spec_url: where to read the spec instead (a path, file:// or s3:// URL).
        run_id: names the run's checkpoint folder; a rerun with the same id resumes it.
        lock_timeout_seconds: how long to wait while another retraining of the same model runs
            before this run is refused; none waits as long as it takes.
        force_promote: why to promote the retrained model even if it is worse than the champion
            (it must still pass the gate); recorded in the registry.
        override_forecast: why to launch a run forecast to miss train.max_minutes or a budget
            (`compute.max_cost_usd`, `train.max_cost_usd`), which is otherwise refused before its
            first job; said in its log and summary. The budget still stops training while it runs.
    """
    spec = retrain_spec(resolve_spec(spec, spec_url))
    runner = StageRunner(spec, run_id or flow_run_id())  # its team decided, and the spec inside it, before all else
    with model_lock(team_model(spec, runner.team), lock_timeout_seconds, holder_label(runner.run_id)) as lock:
        assert spec.registry_url is not None
        registry = Registry(spec.registry_url)
        generation = registry.generation(spec.name)  # a champion changed after this is never overwritten
        champion = registry.champion(spec.name)
        repair_publication(spec)
        watermark = champion.watermark if champion else None
        days = new_partitions(spec.data.train, spec.data.format, watermark, spec.data.ready_marker)
        # a new day with nothing readable fails the run now, naming it, before any job is paid for
        check_new_days(spec.data.train, spec.data.format, watermark, spec.data.ready_marker)
        if not days:
            after = f"after {watermark}" if watermark else "at all"
            name_run(spec, f"nothing new {after}")
            ready = f" marked ready by {spec.data.ready_marker}" if spec.data.ready_marker else ""
            return Completed(message=f"nothing new: {spec.data.train} has no partitions{ready} {after}",
                             data=RunOutcome(nothing_new=True, watermark=watermark))
        base = f"champion v{champion.version}" if champion else "scratch"
        name_run(spec, _window_name(days, base))
        return run_stages(runner,
                          partial(_stages, generation=generation, lock=lock, days=days, base=base,
                                  force_promote=force_promote), STAGES, override_forecast)


def _window_name(days: list[str], base: str) -> str:
    return f"dt={days[0]}..{days[-1]} from {base}" if len(days) > 1 else f"dt={days[0]} from {base}"


def _stages(stage: StageRunner, generation: int, lock: ModelLock, days: list[str], base: str,
            force_promote: str | None) -> RunOutcome:
    cores, trained = through_training(stage, later=("evaluate", "infer", "promote"), retraining=True)
    if trained.skipped:  # the new partitions went away between the listing and the job
        return stage.outcome()
    if trained.partitions and trained.partitions != days:  # a day landed while preflight ran
        name_run(stage.spec, _window_name(trained.partitions, base))
    gated = stage("evaluate", evaluate_gate, trained.checkpoint, cores, against_champion=True, promote=False,
                  generation=generation, force_promote=force_promote, team=stage.team)
    entry = gated.registry
    assert entry is not None  # retraining has a registry
    # the registered version's model: a rerun on the same inputs uses the first run's
    stage("infer", batch_infer, entry.checkpoint, cores, version=entry.version, team=stage.team)
    lock.check()  # promotion is what must never happen outside the model's lock
    stage("promote", promote_champion, entry.version, entry.generation,
          forced=force_promote if entry.forced else None)
    return stage.outcome()
