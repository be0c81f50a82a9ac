"""What a SageMaker or Batch job's state means to trnflow: pure functions from a describe answer
to a `JobState` and, for a failure, the failure record whose `type` names a trnflow error class.

Each failure class has one retry owner:
- SageMaker retries internal errors itself (`RetryStrategy`); one that still ends `Failed` is an
  `InternalServiceError`, not resubmitted. Capacity errors, and transient faults the container
  reported (a lost core, a timeout), are resubmitted by the Prefect task.
- Batch retries host and start-up failures and the container's transient and bad-host exit codes
  itself (`retryStrategy.evaluateOnExit`); a job that still fails on one of them is a `HostFailure`.
  A job its host's ECS agent failed (`AgentLost`) is submitted again by the Prefect task: Batch's
  five rules have no room for it.
- Anything else is the job's own failure (`UserError`, or the trnflow error the container named),
  and is never retried.
"""

from __future__ import annotations

from typing import Any

from trnflow.backends.base import JobState
from trnflow.backends.batch_request import exit_action
from trnflow.records import RecordError, read
from trnflow.results import FailureReport

_SAGEMAKER_PENDING = {"Starting", "Pending", "LaunchingMLInstances", "PreparingTrainingStack", "Downloading",
                      "DownloadingTrainingImage", "Restarting", "Interrupted"}
"""Secondary statuses of a job waiting for its instances: `Interrupted` is a spot job whose instances
were reclaimed, waiting for spot capacity to come back."""
_BATCH_PENDING = {"SUBMITTED", "PENDING", "RUNNABLE", "STARTING"}
CANCEL_REASON = "Cancelled by trnflow"
INTERRUPT_REASON = "Asked to stop by trnflow"
"""A job stopped so that its run yields (its training checkpointed first): failed, not cancelled."""


def failure(kind: str, message: str, retryable: bool) -> FailureReport:
    return FailureReport(type=kind, message=message, retryable=retryable)


def container_report(text: str) -> FailureReport | None:
    """The root-failure record the container wrote (one line of JSON), or None if `text` is not one
    (the job's own code failed before trnflow's container could say why)."""
    try:
        return read(FailureReport, text.strip(), "the container's failure report")
    except RecordError:
        return None


def sagemaker_state(desc: dict[str, Any]) -> JobState:
    status, secondary = desc["TrainingJobStatus"], desc.get("SecondaryStatus", "")
    if status == "InProgress":
        return JobState.PENDING if secondary in _SAGEMAKER_PENDING else JobState.RUNNING
    if status == "Completed":
        return JobState.SUCCEEDED
    if status in ("Stopping", "Stopped"):
        return JobState.FAILED if secondary in ("MaxRuntimeExceeded", "MaxWaitTimeExceeded") or never_trained(
            desc) else JobState.CANCELLED
    return JobState.FAILED


def never_trained(desc: dict[str, Any]) -> bool:
    """A stopped job that never reached `Training`: SageMaker stopped it at its MaxPendingTimeInSeconds
    (a job trnflow stops itself is one it no longer describes)."""
    return desc.get("TrainingJobStatus") == "Stopped" and "Training" not in [
        t.get("Status") for t in desc.get("SecondaryStatusTransitions", [])]


def sagemaker_failure(desc: dict[str, Any]) -> FailureReport:
    """The failure record of a `Failed` (or timed-out) training job, from its `FailureReason`."""
    name = desc["TrainingJobName"]
    if desc.get("SecondaryStatus") == "MaxWaitTimeExceeded":
        limit = desc.get("StoppingCondition", {}).get("MaxWaitTimeInSeconds")
        return failure("CapacityError", f"SageMaker stopped the spot job {name} at its MaxWaitTimeInSeconds ({limit}): "
                       "spot capacity did not let it finish in time; a resubmission resumes from its last checkpoint "
                       "(raise compute.max_wait_hours, or set compute.spot: false)", True)
    if never_trained(desc):
        limit = desc.get("StoppingCondition", {}).get("MaxPendingTimeInSeconds")
        return failure("CapacityError", f"SageMaker found no capacity for {name} within its MaxPendingTimeInSeconds "
                       f"({limit}, compute.max_pending_minutes) and stopped it before it started", True)
    if desc.get("SecondaryStatus") == "MaxRuntimeExceeded":
        limit = desc.get("StoppingCondition", {}).get("MaxRuntimeInSeconds")
        return failure("JobTimeout", f"SageMaker stopped {name} at its MaxRuntimeInSeconds ({limit}); raise "
                       "compute.max_runtime_hours, and rerun to resume from the last checkpoint", False)
    reason = desc.get("FailureReason", "no FailureReason given")
    head, _, rest = reason.partition(":")
    if head == "AlgorithmError":
        report = container_report(rest)
        if report is not None:
            return report.model_copy(update={"message": f"{report.message} (SageMaker job {name})"})
        return failure("UserError", f"the training code of {name} failed: {rest.strip()}", False)
    if head == "CapacityError" or "InsufficientCapacity" in reason:
        return failure("CapacityError", f"SageMaker had no capacity for {name}: {reason}", True)
    if head == "InternalServerError":
        return failure("InternalServiceError", f"SageMaker failed {name} with an internal error after its "
                       f"RetryStrategy retries: {reason}", False)
    return failure("UserError", f"SageMaker failed {name}: {reason}", False)


def batch_state(desc: dict[str, Any]) -> JobState:
    status = desc["status"]
    if status in _BATCH_PENDING:
        return JobState.PENDING
    if status == "RUNNING":
        return JobState.RUNNING
    if status == "SUCCEEDED":
        return JobState.SUCCEEDED
    if desc.get("statusReason") == CANCEL_REASON:
        return JobState.CANCELLED
    return JobState.FAILED


def last_attempt(desc: dict[str, Any]) -> tuple[int | None, str, str]:
    """(exit code, container reason, status reason) of the job's last attempt."""
    attempts = desc.get("attempts") or [{}]
    last = attempts[-1]
    container = last.get("container") or desc.get("container") or {}
    return container.get("exitCode"), container.get("reason", ""), last.get("statusReason") or desc.get(
        "statusReason", "")


def batch_failure(desc: dict[str, Any], rules: list[dict[str, str]], report: FailureReport | None
                  ) -> FailureReport:
    """The failure record of a `FAILED` Batch job. `rules` is its `evaluateOnExit` list; `report` the
    root failure the container uploaded, if any."""
    job = f"{desc.get('jobName')} ({desc['jobId']})"
    code, reason, status_reason = last_attempt(desc)
    attempts = len(desc.get("attempts") or [])
    cause = "; ".join(x for x in (status_reason, reason, None if code is None else f"exit code {code}") if x)
    if exit_action(rules, code, reason, status_reason) == "RETRY":
        if report is not None and report.type == "SpotInterruption":  # spot capacity, not a bad host: go on
            return failure("SpotInterruption", f"EC2 reclaimed the spot instances of {job} in each of its {attempts} "
                           f"attempt(s) ({cause}); the stage submits it again, and it resumes from its last "
                           "checkpoint", True)
        kind = report.type if report else "host failure"
        return failure("HostFailure", f"AWS Batch retried {job} {attempts} time(s) per its retryStrategy and it "
                       f"still failed ({kind}: {cause}); {report.message if report else ''}".rstrip("; "), False)
    if report is None and "AGENT" in (reason or "").upper():  # the host's ECS agent, not the job's code
        return failure("AgentLost", f"the ECS agent on a host of Batch job {job} failed ({cause}); the job's "
                       "retry strategy leaves this to trnflow (Batch takes five rules, and they go to lost hosts, "
                       "tasks that failed to start and exit codes 75 and 79), so the stage submits it again", True)
    if report is not None:
        return report.model_copy(update={"retryable": False, "message": f"{report.message} (Batch job {job})"})
    return failure("UserError", f"Batch job {job} failed: {cause or 'no reason given'}", False)


def batch_billable_seconds(desc: dict[str, Any]) -> float | None:
    """Seconds per node over all attempts (what EC2 bills while the job holds the nodes)."""
    spans = [(a.get("stoppedAt") or 0) - (a.get("startedAt") or 0) for a in desc.get("attempts") or []]
    spans = [s for s in spans if s > 0]
    return sum(spans) / 1000 if spans else None
