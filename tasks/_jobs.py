"""What every stage task shares: run one workload phase on the spec's backend, wait, and turn a
failed job into the error class that decides whether Prefect retries it."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from prefect import get_run_logger

from trnflow.backends import Backend, JobInfo, JobRequest, JobState, backend_for, run_to_end
from trnflow.backends.cloud import placement
from trnflow.errors import ERROR_TYPES, CapacityError, FatalError, TransientError, TrnflowError
from trnflow.events import EVENT_FIELD, parse_event, readable
from trnflow.redact import Redactor
from trnflow.reporting.ledger import JobLedger, LedgerEntry
from trnflow.results import FailureReport, RanOn, StageResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec


def classify(info: JobInfo) -> TrnflowError:
    """The job's root failure as a trnflow error: transient ones are retried, the rest are not."""
    if info.state is JobState.CANCELLED:
        return FatalError(f"job {info.job_id} was cancelled")
    failure = info.failure or FailureReport(type="Unknown", message="no failure report")
    text = Redactor.from_env()(f"job {info.job_id}: {failure}")
    bad_cores = failure.bad_cores
    if failure.type in ERROR_TYPES:
        return ERROR_TYPES[failure.type](text, bad_cores=bad_cores)
    if failure.retryable:
        return TransientError(text, bad_cores=bad_cores)
    return FatalError(text, bad_cores=bad_cores)


def relay(logger: Any, redact: Redactor, text: str) -> None:
    """A job's output into the task's log: its events in words at INFO (each carrying its event,
    for the CLI's progress bars), their JSON at DEBUG, any other line as it is; secrets masked."""
    for line in text.splitlines():
        if not line.strip():
            continue
        line = redact(line)
        event = parse_event(line)
        if event is None:
            logger.info("%s", line)
            continue
        logger.debug("%s", line)
        logger.info("%s", readable(event), extra={EVENT_FIELD: event})


@contextlib.contextmanager
def _forwarded(source: logging.Logger, logger: Any) -> Iterator[None]:
    """What `source` logs at WARNING or above while the block runs, in the task run's log too (where
    the Prefect UI shows it), from this thread only."""
    thread = threading.get_ident()

    class Relay(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == thread:
                logger.log(record.levelno, "%s", record.getMessage())

    handler = Relay(logging.WARNING)
    source.addHandler(handler)
    try:
        yield
    finally:
        source.removeHandler(handler)


def run_job(spec: JobSpec, phase: str, run_id: str, *, processes: int | None = None,
            checkpoint: str | None = None, cores: list[int] | None = None,
            exclude_cores: set[int] | None = None) -> StageResult:
    """Submit one phase, stream its log into the task's log, and return rank 0's result, typed, with
    the cores it ran on (`cores`) and where it ran (`ran_on`). A job that found no capacity for its
    instance type is submitted again for the next of compute.instance_preferences, where the backend
    does not choose among them itself (Batch)."""
    backend = backend_for(spec, TrnflowSettings())
    picks = getattr(backend, "picks_instance_type", True)
    choices = [spec] if picks else [spec.on_instance(t) for t in spec.compute.instance_choices]
    request = JobRequest(spec, phase, run_id, processes=processes, checkpoint=checkpoint,
                         cores=tuple(cores) if cores else None, exclude_cores=frozenset(exclude_cores or ()))
    for following, choice in zip([*choices[1:], None], choices, strict=True):
        try:
            return _run(backend, replace(request, spec=choice))
        except CapacityError as exc:
            if following is None:
                raise
            get_run_logger().warning("%s: no capacity for %s (%s); trying %s, the next of "
                                     "compute.instance_preferences", phase, choice.compute.instance_type, exc,
                                     following.compute.instance_type)
    raise AssertionError("unreachable: the last choice returns or raises")


def _run(backend: Backend, request: JobRequest) -> StageResult:
    logger, settings = get_run_logger(), TrnflowSettings()
    spec, phase = request.spec, request.phase
    assert spec is not None, "stage jobs always carry a spec"

    def submitted(job_id: str) -> None:
        logger.info("%s job %s submitted to the %s backend on %d core(s)", phase, job_id, backend.name,
                    request.world_size)

    try:
        with _forwarded(logging.getLogger("trnflow.backends"), logger):  # waiting for cores, a failed cancel
            _, info = run_to_end(backend, request, settings.poll_seconds, on_submit=submitted,
                                 on_logs=functools.partial(relay, logger, Redactor.from_env()))
    except TrnflowError:
        raise
    except Exception as exc:  # the backend itself failed: say so; the error class decides on retries
        raise FatalError(f"{phase}: the {backend.name} backend failed: {exc}") from exc
    got = info.details.get("instance_type") or spec.compute.instance_type
    JobLedger(settings.home, request.run_id).record(LedgerEntry(
        phase, info.job_id, str(info.state), info.details.get("seconds") or 0.0, nodes=placement(request)[0],
        instance_type=got, spot=bool(info.details.get("spot")), running_seconds=info.details.get("running_seconds")))
    if got != spec.compute.instance_type:
        logger.info("%s job %s got %s (compute.instance_preferences)", phase, info.job_id, got)
    if info.state is JobState.SUCCEEDED and info.result is not None:
        result = info.result
        result.ran_on = RanOn(backend=backend.name, job_id=info.job_id, instance_type=got,
                              hosts=info.details.get("hosts") or [])
        if result.device is not None:
            logger.info("%s ran on the %s device (%s)", phase, result.device.name, result.device.reason)
        return result
    raise classify(info)


def recompile_note(result: StageResult) -> str:
    """', N recompilation(s)' when the job compiled graphs the compile cache did not have (each is
    logged with its shapes), else ''."""
    recompiles = result.compile.recompiles if result.compile else []
    logger = get_run_logger()
    for r in recompiles:
        logger.warning("recompilation: %s needed %s (%s) because %s", r["program"], r["key"], r["shapes"],
                       r["reason"])
    return f", {len(recompiles)} recompilation(s)" if recompiles else ""
