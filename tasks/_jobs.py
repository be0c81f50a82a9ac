"""What every stage task shares: run one workload phase on the spec's backend, wait, and turn a
failed job into the error class that decides whether Prefect retries it."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger

from jobspecs import JobSpec
from trnflow.backends import JobInfo, JobRequest, JobState, backend_for, wait
from trnflow.errors import ERROR_TYPES, FatalError, TransientError, TrnflowError
from trnflow.settings import TrnflowSettings


def classify(info: JobInfo) -> TrnflowError:
    """The job's root failure as a trnflow error: transient ones are retried, the rest are not."""
    if info.state is JobState.CANCELLED:
        return FatalError(f"job {info.job_id} was cancelled")
    failure = info.failure or {}
    kind, message = failure.get("type", "Unknown"), failure.get("message", "no failure report")
    text = f"job {info.job_id}: {kind}: {message}"
    if kind in ERROR_TYPES:
        return ERROR_TYPES[kind](text)
    if failure.get("retryable"):
        return TransientError(text)
    return FatalError(text)


def run_job(spec: JobSpec, phase: str, run_id: str, *, processes: int | None = None,
            checkpoint: str | None = None) -> dict[str, Any]:
    """Submit one phase, stream its log into the task's log, and return rank 0's result."""
    logger = get_run_logger()
    settings = TrnflowSettings()
    backend = backend_for(spec, settings)
    request = JobRequest(spec, phase, run_id, processes=processes, checkpoint=checkpoint)
    job_id = backend.submit(request)
    logger.info("%s job %s submitted to the %s backend on %d core(s)", phase, job_id, backend.name,
                request.world_size)

    def relay(text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                logger.info("%s", line)

    info = wait(backend, job_id, settings.poll_seconds, on_logs=relay)
    if info.state is JobState.SUCCEEDED and info.result is not None:
        return info.result
    raise classify(info)
