"""What every stage task shares: run one workload phase on the spec's backend, wait, and turn a
failed job into the error class that decides whether Prefect retries it."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.exceptions import PrefectHTTPStatusError
from prefect.runtime import flow_run
from prefect.states import Running

from trnflow.backends import Backend, JobInfo, JobRequest, JobState, asked_to_yield, backend_for, wait
from trnflow.backends.base import cancel_within
from trnflow.backends.cloud import node_identities, phase_result, placement, proceed, proceed_wait_seconds
from trnflow.backends.contract import JobOutputs
from trnflow.errors import (
    ERROR_TYPES,
    CapacityError,
    FatalError,
    Preempted,
    TransientError,
    TrnflowError,
)
from trnflow.events import EVENT_FIELD, parse_event, readable
from trnflow.redact import Redactor, printable
from trnflow.reporting.ledger import JobLedger, LedgerEntry
from trnflow.results import FailureReport, Proceed, RanOn, StageResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec
from trnflow.teams import Team


def classify(info: JobInfo) -> TrnflowError:
    """The job's root failure as a trnflow error: transient ones are retried, the rest are not."""
    if info.state is JobState.CANCELLED:
        return FatalError(f"job {info.job_id} was cancelled")
    failure = info.failure or FailureReport(type="Unknown", message="no failure report")
    text = printable(Redactor.from_env()(f"job {info.job_id}: {failure}"))
    bad_cores = failure.bad_cores
    if failure.type in ERROR_TYPES:
        return ERROR_TYPES[failure.type](text, bad_cores=bad_cores)
    if failure.retryable:
        return TransientError(text, bad_cores=bad_cores)
    return FatalError(text, bad_cores=bad_cores)


def relay(logger: Any, redact: Redactor, text: str) -> None:
    """A job's output into the task's log: its events in words at INFO (each carrying its event,
    for the CLI's progress bars), their JSON at DEBUG, any other line as it is; secrets masked, and
terminal control sequences removed (`printable`)."""
    for line in text.splitlines():
        if not line.strip():
            continue
        line = printable(redact(line))
        event = parse_event(line)
        if event is None:
            logger.info("%s", line)
            continue
        logger.debug("%s", line)
        if event["event"] == "late":  # training will miss train.max_minutes: said now, not at the end
            logger.warning("%s", readable(event), extra={EVENT_FIELD: event})
            said_late(f"{event.get('message', 'training will miss its deadline')}", logger)
        else:
            logger.info("%s", readable(event), extra={EVENT_FIELD: event})


AT_RISK = "DeadlineAtRisk"
"""The flow run's state (still running) once training is forecast to miss train.max_minutes. Not
`Late`: Prefect names a scheduled run nobody has started so."""


WAITING = "Waiting"
"""The flow run's state (still running) while it waits for what it needs before its next job: its
cores in the machine's queue, its model's lock."""
PREEMPTED = "Preempted"
"""The flow run's state (still running) once it yielded its capacity, until it has it again."""


def said_late(message: str, logger: Any) -> None:
    """Put the flow run in the state `AT_RISK` (still running), `message` its state message."""
    running_as(AT_RISK, message, logger)


def running_as(name: str, message: str, logger: Any) -> None:
    """Put the flow run in a running state named `name` (`Running` itself, `Waiting`, `AT_RISK`),
    `message` its state message, where the Prefect UI's runs list shows it; the flow's end replaces
    it as usual. A server that refuses costs only the state: the log says the same."""
    run = flow_run.get_id()
    if not run:
        return
    try:
        with get_client(sync_client=True) as client:
            now = client.read_flow_run(run).state
            if now is None or not now.is_running():  # never over a cancellation or a pause
                return
            client.set_flow_run_state(run, Running(name=name, message=message[:400]), force=True)
    except Exception as exc:  # the API's errors are many; the run goes on either way
        logger.warning("could not set the flow run's state to %s: %s", name, exc)


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


@dataclass
class _Job:
    """A submitted job being followed: its backend (the same object throughout, as it keeps the job's
    watch), its request, and how much of its log has been relayed."""

    backend: Backend
    request: JobRequest
    job_id: str
    offset: int = 0
    _outputs: Any = None
    yielded_to: str | None = None
    """The run its run yields to, once the job was asked to stop for it."""

    @property
    def outputs(self) -> Any:
        """Where the job's nodes leave their results (backends that share allocations), opened once."""
        if self._outputs is None:
            self._outputs = self.backend.outputs(self.job_id)
        return self._outputs


_KEPT: dict[str, _Job] = {}
"""Per run id, the job whose instances passed the preflight and now wait for the run's training
(on backends that run both in one allocation)."""
PREFLIGHT_FIRST = ("train",)
"""Phases that, on such a backend, always run the preflight first on their own instances: a node
that did not pass it never trains (a retry's new instances included)."""


def run_job(spec: JobSpec, phase: str, run_id: str, *, processes: int | None = None,
            checkpoint: str | None = None, cores: list[int] | None = None,
            exclude_cores: set[int] | None = None, keep_for: tuple[str, ...] = (),
            team: Team | None = None, budget_usd: float | None = None) -> StageResult:
    """Submit one phase, stream its log into the task's log, and return rank 0's result, typed, with
    the cores it ran on (`cores`) and where it ran (`ran_on`). A job that found no capacity for its
    instance type is submitted again for the next of compute.instance_preferences, where the backend
    does not choose among them itself (Batch).

    On a backend that runs several phases in one allocation (SageMaker, Batch), `keep_for` names the
    phases to run next on the same instances: the job runs them too, each waiting until `run_job`
    is called for it, and this returns as soon as `phase` has ended. Training there runs the
    preflight first on its own instances unless a kept job is waiting for it. The job is `team`'s:
    the run's, decided once before its first job (None: decided here). `budget_usd`: what training
    may cost (`JobRequest.budget_usd`), given to a kept job with its word."""
    kept = _KEPT.get(run_id)
    if kept is not None and phase in kept.request.phases[1:]:
        del _KEPT[run_id]
        if _usable(kept):
            return _go_on(kept, phase, budget_usd)
        get_run_logger().warning("job %s ended, or waited too long for %s; new instances pass the preflight first",
                                 kept.job_id, phase)
        release(kept, "it waited too long for its word")  # billed
    if kept is not None and phase == kept.request.phases[0]:  # the preflight again: new instances
        del _KEPT[run_id]
        release(kept, f"{phase} runs again on other instances")
    backend = backend_for(spec, TrnflowSettings(), team)  # the run's team: never decided again per stage
    chain = (phase,)
    if backend.shares_allocation:
        chain = (phase, *keep_for) if keep_for else ("sanity", phase) if phase in PREFLIGHT_FIRST else chain
    choices = [spec] if backend.picks_instance_type else [spec.on_instance(t) for t in spec.compute.instance_choices]
    request = JobRequest(spec, "+".join(chain), run_id, processes=processes, checkpoint=checkpoint,
                         cores=tuple(cores) if cores else None, exclude_cores=frozenset(exclude_cores or ()),
                         budget_usd=budget_usd)
    for following, choice in zip([*choices[1:], None], choices, strict=True):
        try:
            return _run(backend, replace(request, spec=choice), phase)
        except CapacityError as exc:
            if following is None:
                raise
            get_run_logger().warning("%s: no capacity for %s (%s); trying %s, the next of "
                                     "compute.instance_preferences", phase, choice.compute.instance_type, exc,
                                     following.compute.instance_type)
    raise AssertionError("unreachable: the last choice returns or raises")


def _run(backend: Backend, request: JobRequest, phase: str) -> StageResult:
    logger = get_run_logger()
    with _forwarded(logging.getLogger("trnflow.backends"), logger):  # waiting for cores, a failed cancel
        try:
            job = _Job(backend, request, backend.submit(request))
        except TrnflowError:
            raise
        except Exception as exc:  # the backend itself failed: say so; the error class decides on retries
            raise FatalError(f"{phase}: the {backend.name} backend failed: {exc}") from exc
    chain = " then ".join(request.phases) + " on the same instances" if len(request.phases) > 1 else phase
    logger.info("%s job %s submitted to the %s backend on %d core(s)", chain, job.job_id, backend.name,
                request.world_size)
    with _released_on_error(job):
        if len(request.phases) > 1 and phase == request.phases[0]:  # the later phases wait for their word
            info, ended = _follow(job, phase)
            if ended is not None and not info.state.terminal:
                _KEPT[request.run_id] = job
                return _where(ended, job, info)
            if ended is not None:  # the job ended after it: a failed preflight ends it
                _record(job, info)
                return _where(ended, job, info)
        else:
            if len(request.phases) > 1:  # nothing to wait for before `phase`: it starts after the preflight
                proceed(job.outputs, Proceed(phase=phase, go=True, budget_usd=request.budget_usd))
            info = _follow(job, None)[0]
    return _finish(job, info)


WORD_MARGIN_SECONDS = 120.0
"""A kept job whose nodes would give up waiting for the word sooner than this is not used: new
instances, preflighted first, are surer than a word that may come too late."""


def _usable(job: _Job) -> bool:
    """Whether the kept job is still running and its nodes still wait long enough for the word."""
    spec = job.request.spec
    assert spec is not None
    try:
        if job.backend.describe(job.job_id).state.terminal:
            return False
        ended = job.outputs.list(JobOutputs.phase_result(job.request.phases[0]))
    except Exception:  # a job the service cannot describe is not one to go on with
        return False
    return bool(ended) and time.time() - ended[-1].modified < proceed_wait_seconds(spec) - WORD_MARGIN_SECONDS


def _go_on(job: _Job, phase: str, budget_usd: float | None) -> StageResult:
    """Start `phase` in the kept job (its nodes wait for the word), with its budget, and follow it
    to the end."""
    get_run_logger().info("%s starts in job %s, on the instances that passed the preflight", phase, job.job_id)
    with _released_on_error(job):
        proceed(job.outputs, Proceed(phase=phase, go=True, budget_usd=budget_usd))
        info = _follow(job, None)[0]
    return _finish(job, info)


@contextlib.contextmanager
def _released_on_error(job: _Job) -> Iterator[None]:
    """While following a job: if anything goes wrong here (the service, a record that does not
    read, an interrupted caller), the job is cancelled and billed rather than left holding its
    instances. The job's own failure is raised later, by `_finish`."""
    try:
        yield
    except TrnflowError:
        release(job, "the orchestrator stopped following it")
        raise
    except Exception as exc:
        release(job, "the orchestrator stopped following it")
        raise FatalError(f"{job.request.phase}: the {job.backend.name} backend failed: {exc}") from exc
    except BaseException:  # a stopped caller stops at once: the job is billed as the service has it now
        release(job, "the orchestrator was stopped", bill_within=0.0, tell_nodes=False)
        raise


RELEASE_BILL_SECONDS = 30.0
"""How long a released job's end is waited for, so that its ledger line has the time the service billed."""


def release(job: _Job, reason: str, bill_within: float = RELEASE_BILL_SECONDS, tell_nodes: bool = True) -> None:
    """End a job whose next phase will not come: tell its nodes (unless the caller is being stopped,
    and a service that does not answer must not hold it up), cancel it, and bill it once it ended
    (waiting at most `bill_within` seconds for that)."""
    if tell_nodes and len(job.request.phases) > 1:
        with contextlib.suppress(Exception):  # the nodes' word is a courtesy: the cancel is what counts
            proceed(job.outputs, Proceed(phase=job.request.last_phase, go=False, reason=reason))
    if not cancel_within(job.backend, job.job_id):
        return  # not billed: the warning says to stop it by hand
    deadline = time.monotonic() + bill_within
    with contextlib.suppress(Exception):
        info = job.backend.describe(job.job_id)
        while not info.state.terminal and time.monotonic() < deadline:
            time.sleep(1.0)
            info = job.backend.describe(job.job_id)
        _record(job, info)


def release_kept(run_id: str, reason: str) -> bool:
    """End the run's kept job, if it has one (the run stopped before training); whether it had one,
    now billed in the run's ledger."""
    kept = _KEPT.pop(run_id, None)
    if kept is not None:
        release(kept, reason)
    return kept is not None


def _follow(job: _Job, phase: str | None) -> tuple[JobInfo, StageResult | None]:
    """Relay the job's log into the task's log until `phase`'s result is uploaded, or the job ends:
    its state then, and that result (None when the job ended first, or `phase` is None). Callers
    release the job if this raises (`_released_on_error`)."""
    logger = get_run_logger()
    found: list[StageResult] = []

    def ended(_: JobInfo) -> bool:
        _yield_if_asked(job, logger)
        result = phase_result(job.outputs, phase, job.job_id) if phase is not None else None
        found.extend([result] if result is not None else [])
        return bool(found)

    with _forwarded(logging.getLogger("trnflow.backends"), logger):  # a failed cancel, a stopped node
        info = wait(job.backend, job.job_id, TrnflowSettings().poll_seconds, until=ended, offset=job.offset,
                    on_logs=functools.partial(relay, logger, Redactor.from_env()))
    job.offset = info.details.log_offset
    if phase is not None and not found:  # it ended: a result uploaded as it ended counts
        ended(info)
    return info, (found[0] if found else None)


def _yield_if_asked(job: _Job, logger: Any) -> None:
    """Stop a training job whose run was asked to yield (`asked_to_yield`): once, at the job's next
    step boundary, where it checkpoints."""
    if job.yielded_to is not None or "train" not in job.request.phases:
        return
    try:
        asked = asked_to_yield(job.request.run_id)
    except (httpx.HTTPError, PrefectHTTPStatusError, TrnflowError) as exc:  # the stack's queue did not answer
        logger.warning("whether this run is asked to yield could not be read (%s); asked again at the next look", exc)
        return
    if asked is None:
        return
    logger.warning("this run yields its cores to %s (%s): training stops at its next step boundary, checkpointed",
                   asked.label, asked.priority_class)
    job.backend.interrupt(job.job_id)
    job.yielded_to = asked.label


def _record(job: _Job, info: JobInfo) -> str:
    """Bill the ended job in the run's ledger; the instance type it got."""
    spec = job.request.spec
    assert spec is not None, "stage jobs always carry a spec"
    details = info.details
    got = details.instance_type or spec.compute.instance_type
    JobLedger(TrnflowSettings().home, job.request.run_id).record(LedgerEntry(
        job.request.phase, info.job_id, str(info.state), details.seconds or 0.0,
        nodes=placement(job.request)[0], instance_type=got, spot=details.spot, running_seconds=details.running_seconds,
        instances_started=details.instances_started, provisioning_seconds=details.provisioning_seconds,
        price_per_hour=details.price_per_hour))
    return got


def _where(result: StageResult, job: _Job, info: JobInfo) -> StageResult:
    """The result, with where its job ran: the hosts the service names for its nodes (Batch: the EC2
    instance of each, in its latest attempt; SageMaker: algo-1, ...), else, for a cloud job, the host
    names its nodes found themselves on (for a job of several phases, the same ones for each)."""
    spec = job.request.spec
    assert spec is not None
    hosts = info.details.hosts
    if not hosts and job.backend.shares_allocation:
        with contextlib.suppress(Exception):
            hosts = [n.label for n in node_identities(job.outputs)]
    result.ran_on = RanOn(backend=job.backend.name, job_id=info.job_id, hosts=hosts,
                          instance_type=info.details.instance_type or spec.compute.instance_type)
    if result.device is not None:
        get_run_logger().info("%s ran on the %s device (%s)", result.phase, result.device.name, result.device.reason)
    return result


def _finish(job: _Job, info: JobInfo) -> StageResult:
    """The ended job's result, billed and placed; its failure as the error class that decides on retries."""
    spec = job.request.spec
    assert spec is not None
    got = _record(job, info)
    if got != spec.compute.instance_type:
        get_run_logger().info("%s job %s got %s (compute.instance_preferences)", job.request.phase, info.job_id, got)
    if info.state is JobState.SUCCEEDED and info.result is not None:
        return _where(info.result, job, info)
    error = classify(info)
    # stopped in its start-up too; SageMaker says Stopped, with no reason, for the job it was asked to stop
    if job.yielded_to is not None and (isinstance(error, TransientError) or info.state is JobState.CANCELLED):
        raise Preempted(f"yielded its capacity to {job.yielded_to}: {error}")
    raise error


def recompile_note(result: StageResult) -> str:
    """', N recompilation(s)' when the job compiled graphs the compile cache did not have (each is
    logged with its shapes), else ''."""
    recompiles = result.compile.recompiles if result.compile else []
    logger = get_run_logger()
    for r in recompiles:
        logger.warning("recompilation: %s needed %s (%s) because %s", r.program, r.key, r.shapes, r.reason)
    return f", {len(recompiles)} recompilation(s)" if recompiles else ""
