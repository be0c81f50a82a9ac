"""The parity reference of a run whose spec asks for one automatically (`gate.reference: auto`):
the spec trained in plain fp32, as a GPU run of the same job would be, kept under the spec's
checkpoints by the digest of what decides its numbers. A run finds it on record when an earlier run
of the same spec and data trained it; otherwise this stage trains it, after the candidate (on the
cores the candidate trained on), a retry resuming where the last attempt checkpointed."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from trnflow.backends.reference import keep_reference, reference_spec
from trnflow.lifecycle.gate import read_series
from trnflow.lifecycle.references import on_record, reference_url
from trnflow.results import ReferenceResult, TrainResult
from trnflow.specs import JobSpec
from trnflow.tasks._jobs import run_job
from trnflow.teams import Team


@task(name="reference", cache_policy=NO_CACHE)
def fp32_reference(spec: JobSpec, run_id: str, cores: list[int], budget_usd: float | None = None, *,
                   team: Team | None = None) -> ReferenceResult | State:
    """The reference the gate judges against: on record (the task ends Completed, named Skipped),
    or trained now by a training job of the run, whose cost is the stage's and may be at most
    `budget_usd` (what the run's budget leaves; None: no limit). Its place is decided once, here:
    the evaluate stage reads the result's `url`. Its jobs are `team`'s."""
    url = reference_url(spec)  # the digest of the data as it is now: the same place for the whole stage
    assert spec.gate.reference == "auto" and url is not None
    if on_record(spec, url):
        series = read_series(url.rpartition("/")[0])  # the reference's metrics.json
        last = series.points[-1] if series and series.points else None
        result = ReferenceResult(url=url, trained=False, checkpoint=series.checkpoint if series else None,
                                 final=last, summary=f"on record, trained by an earlier run of this spec and data: "
                                 f"{_point(spec, last)}")
        return Completed(name="Skipped", message=result.summary, data=result)
    get_run_logger().info("no fp32 reference of this spec and data on record at %s: training it", url)
    trained = run_job(reference_spec(spec, url), "train", run_id, cores=cores, team=team, budget_usd=budget_usd)
    assert isinstance(trained, TrainResult)
    document = keep_reference(spec, trained, f"{run_id} (reference)", url)
    return ReferenceResult(url=url, trained=True, checkpoint=trained.checkpoint, final=document.last,
                           device=trained.device, cores=trained.cores, ran_on=trained.ran_on, compile=trained.compile,
                           phase="train", summary=f"trained in fp32: {trained.steps_trained} steps, "
                           f"{_point(spec, document.last)}; kept for the next run")


def _point(spec: JobSpec, point) -> str:
    """`accuracy 0.9125 at step 300`, the reference's last evaluation in the gate's metric."""
    if point is None or spec.gate.metric not in point.values:
        return "no evaluation"
    return f"{spec.gate.metric} {point.values[spec.gate.metric]:.4f} at step {point.step}"
