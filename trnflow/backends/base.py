"""The Backend protocol: every place a stage job can run offers submit, describe, logs and cancel."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from trnflow.records import RecordError, read
from trnflow.results import RESULTS, FailureReport, StageResult
from trnflow.specs import JobSpec

log = logging.getLogger("trnflow.backends")


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)


@dataclass(frozen=True)
class JobRequest:
    """One run of one workload phase."""

    spec: JobSpec | None
    """None only for the hardware phases (sanity, collectives) run without a job spec."""
    phase: str
    run_id: str
    processes: int | None = None
    """Worker processes; None means one per NeuronCore of the spec."""
    checkpoint: str | None = None
    """Checkpoint URL for the evaluate and infer phases."""
    cores: tuple[int, ...] | None = None
    """Run on exactly these NeuronCores (for example the ones preflight verified)."""
    exclude_cores: frozenset[int] = frozenset()
    """Never place the job on these cores (cores that failed preflight)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Phase options, such as the collective sweep's sizes."""
    instance_type: str | None = None
    """The instance to emulate when there is no spec."""
    budget_usd: float | None = None
    """What training may cost, in US dollars at on-demand prices, as the orchestrator reckoned it (the
    run's budget less what it spent, or the spec's train.max_cost_usd); None: no limit. The spec
    itself stays as its user wrote it."""

    @property
    def world_size(self) -> int:
        if self.processes:
            return self.processes
        if self.spec is None:
            raise ValueError("a request without a spec must say how many processes it wants")
        return self.spec.compute.world_size

    @property
    def name(self) -> str:
        return self.spec.name if self.spec else "adhoc"

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases the job runs in turn on the same instances (`sanity+train`: two)."""
        return tuple(self.phase.split("+"))

    @property
    def last_phase(self) -> str:
        """The phase whose result the job ends with, and whose stage kind it runs as."""
        return self.phases[-1]

    @property
    def itype(self) -> str:
        return self.spec.compute.instance_type if self.spec else (self.instance_type or "trn1.32xlarge")


def fitted(request: JobRequest) -> JobRequest:
    """The request as every backend submits it: refused (FatalError naming the fewest cores that
    would fit) when the model fits no core of any instance type the job may get, before any job
    exists, and with `auto` decided (the planner's layout), so that every rank of the job spreads
    the model alike whatever its own environment (a run's flow decides it when it starts)."""
    if request.spec is None:
        return request
    from trnflow.workload.memory import check_fits  # builds the recipe's model (torch): submissions only

    return replace(request, spec=request.spec.with_layout(check_fits(request.spec).layout))


@dataclass
class JobDetails:
    """What a backend knows of a job besides its state: what it is billed for and where it ran.
    Fields a backend cannot know stay None."""

    seconds: float | None = None
    """Billable seconds (per node), once the service has them."""
    status: str | None = None
    """The service's own word for the job's state (`InProgress`, `RUNNABLE`, ...)."""
    cores: list[int] | None = None
    """The NeuronCores the job ran on, where trnflow placed it (the local backend)."""
    instance_type: str | None = None
    """The instance type the service gave the job, where it chose among several."""
    hosts: list[str] = field(default_factory=list)
    """The hosts the service names."""
    spot: bool = False
    running_seconds: float | None = None
    """Seconds the job ran, for a spot job whose billed time differs."""
    price_per_hour: float | None = None
    """The price per node-hour the service charged, where it is known (a spot price)."""
    instances_started: int | None = None
    provisioning_seconds: float | None = None
    attempts: int | None = None
    """Batch's attempts so far."""
    restarts: int | None = None
    """SageMaker's restarts so far."""
    exit_code: int | None = None
    """The local job's exit code."""
    log_offset: int = 0
    """How far its log has been read (set by `wait`)."""


@dataclass
class JobInfo:
    job_id: str
    state: JobState
    result: StageResult | None = None
    """Rank 0's result, typed by its phase (`stage_result`), once the job succeeded."""
    failure: FailureReport | None = None
    """The root failure, once the job failed: its type, message, and whether a retry can help."""
    details: JobDetails = field(default_factory=JobDetails)

    def failed(self) -> str:
        """The failure in one line, for a command's error message."""
        return str(self.failure) if self.failure else f"job {self.job_id} {self.state.lower()} with no failure report"


def stage_result(job_id: str, data: bytes | str, cores: list[int] | None) -> StageResult:
    """A job's `result.json` (rank 0's) as the model of the phase it names, with the cores the job
    ran on (None where the service placed it): the one place a job's result enters the
    orchestrating side. A field its phase's model does not know is a RecordError naming the field."""
    origin = f"job {job_id}: result.json"
    try:
        phase = json.loads(data).get("phase")
    except (ValueError, AttributeError):
        phase = None
    if phase not in RESULTS:
        raise RecordError(origin, f"phase: {phase!r} is none of {', '.join(RESULTS)}",
                          "the job did not write a trnflow result")
    return read(RESULTS[phase], {**json.loads(data), "cores": cores}, origin)


@runtime_checkable
class Backend(Protocol):
    name: str
    shares_allocation: bool
    """Whether one job runs several phases on the same instances (the preflight, then training),
    its nodes placing their own cores and leaving their results in `outputs`; else this machine
    places each job's cores."""
    picks_instance_type: bool
    """Whether the service itself chooses among compute.instance_preferences (else trnflow submits
    again for the next type when one has no capacity)."""

    def submit(self, request: JobRequest) -> str: ...

    def outputs(self, job_id: str) -> Any:
        """Where a job's nodes leave their results, failures and identities as it runs (a store),
        on a backend that `shares_allocation`; None elsewhere."""
        ...

    def stop_command(self, job_id: str) -> str:
        """The command that stops the job by hand, for when trnflow could not."""
        ...

    def describe(self, job_id: str) -> JobInfo: ...

    def logs(self, job_id: str, since: int = 0) -> tuple[str, int]:
        """The job's complete log lines from byte offset `since`, and the offset after them."""
        ...

    def cancel(self, job_id: str) -> None: ...

    def interrupt(self, job_id: str) -> None:
        """Ask the job to stop as its service stops one (SIGTERM, then a grace period): training
        checkpoints at its next step boundary and ends `Interrupted`. Other phases just end."""
        ...


def wait(backend: Backend, job_id: str, poll_seconds: float = 0.5, on_logs=None, until=None,
         offset: int = 0) -> JobInfo:
    """Poll until the job ends, or `until(info)` is true; `on_logs(text)` receives new complete log
    lines as they appear, read from byte `offset`. Returns the job's state then; the offset after
    the lines read is in its `details.log_offset` (to go on reading from there)."""
    while True:
        info = backend.describe(job_id)
        if on_logs is not None:
            text, offset = backend.logs(job_id, since=offset)
            if text:
                on_logs(text)
        info.details.log_offset = offset
        if info.state.terminal or (until is not None and until(info)):
            return info
        time.sleep(poll_seconds)


CANCEL_SECONDS = 20.0
"""How long an interrupted caller waits for its job's cancellation before it goes on stopping (the
local backend's own cancel gives a job 10 s after SIGTERM before it kills it)."""


def cancel_within(backend: Backend, job_id: str, seconds: float = CANCEL_SECONDS) -> bool:
    """Cancel the job, waiting at most `seconds` for the backend to take it: a caller that is being
    stopped must stop even when the service no longer answers (a cloud endpoint that is gone, and
    whose calls would be retried for minutes). False, with a warning naming the job, when the
    cancellation failed or did not finish in time."""
    outcome: list[BaseException | None] = []

    def cancel() -> None:
        try:
            backend.cancel(job_id)
            outcome.append(None)
        except Exception as exc:  # reported below: the caller's own exception is the one that counts
            outcome.append(exc)

    worker = threading.Thread(target=cancel, name=f"cancel-{job_id}", daemon=True)
    worker.start()
    worker.join(seconds)
    if outcome == [None]:
        return True
    why = f"it failed: {outcome[0]}" if outcome else f"the {backend.name} backend did not answer within {seconds:g} s"
    log.warning("could not cancel %s job %s (%s); it may still be running: stop it with `%s`", backend.name, job_id,
                why, backend.stop_command(job_id))
    return False


def run_to_end(backend: Backend, request: JobRequest, poll_seconds: float = 0.5, on_logs=None,
               on_submit=None) -> tuple[str, JobInfo]:
    """Submit, then wait for the end. If the caller is interrupted (Ctrl-C, a cancelled flow run),
    the job is cancelled rather than left holding its cores (`cancel_within`)."""
    job_id = backend.submit(request)
    if on_submit is not None:
        on_submit(job_id)
    try:
        return job_id, wait(backend, job_id, poll_seconds, on_logs)
    except BaseException:
        cancel_within(backend, job_id, CANCEL_SECONDS)
        raise
