"""`trnflow serve`: every flow's deployment for each spec, served from this process until it is
stopped, and stopping cleanly.

Ctrl-C and SIGTERM stop it alike, within `STOP_SECONDS` whatever the server's state: the runs it
started are cancelled (their jobs stopped, their models' slots given back) and its deployments
paused, so their schedules create no runs while nothing serves them. A server that stops
answering ends serving too, saying so. While it serves, it names the runs the server's scheduler
created for its deployments (`name_upcoming`), which the server names at random.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import httpx
import prefect.runner.runner as runner_module
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.runner import Runner
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, get_current_settings, temporary_settings
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from trnflow.flows._params import SERVED
from trnflow.flows.deployments import runner_deployments, upcoming_name
from trnflow.specs import JobSpec

STOP_SECONDS = 20.0
"""How long `trnflow serve` may take to stop once told to (Ctrl-C, SIGTERM): cancelling the runs it
started and pausing its deployments need the server, which may be gone; past this it exits anyway."""


@dataclass(frozen=True)
class Stopped:
    """How serving ended: the deployments it paused, or why it could not pause them."""
    deployments: list[str]
    paused: bool
    problem: str = ""


class _Deadline:
    """Once armed, ends this process after `seconds` whatever it is waiting for; a Ctrl-C after
    arming ends it at once."""

    def __init__(self, seconds: float):
        self.seconds, self.armed = seconds, False

    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        timer = threading.Timer(self.seconds, self._give_up)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGINT, lambda *_: os._exit(130))

    def _give_up(self) -> None:
        print(f"trnflow serve: did not stop within {self.seconds:.0f} s (is the Prefect server gone?); exiting "
              "without pausing the deployments", file=sys.stderr, flush=True)
        os._exit(1)


GONE_CHECKS = (5.0, 4)
"""How `trnflow serve` decides its server is gone: this many seconds between health checks, and
this many unanswered in a row. Prefect's runner would give up after three polls with their
tracebacks, or sometimes hang (`_scheduled_polls_left_to_the_watch`); this ends serving, saying why."""


def _server_answers(seconds: float) -> bool:
    """Whether the Prefect server answers its health check within `seconds`."""
    try:
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), \
                get_client(sync_client=True, httpx_settings={"timeout": seconds}) as client:
            return client.api_healthcheck() is None
    except Exception:  # any way of not answering is an answer here
        return False


def _server_gone() -> None:
    """Say that the server stopped answering and what to do, and end this process (exit 1)."""
    sys.stdout.flush()
    print(f"trnflow serve: the Prefect server at {PREFECT_API_URL.value()} stopped answering, so serving stopped; "
          "its deployments were not paused, and their schedules create runs again once it is back: start the "
          "server, then run `trnflow serve` again", file=sys.stderr, flush=True)
    os._exit(1)


def _watch_server(stopping: threading.Event, every: float, misses: int) -> None:
    """Until `stopping` is set, check the server every `every` seconds; `misses` unanswered
    checks in a row end serving (`_server_gone`)."""
    missed = 0
    while not stopping.wait(every):
        missed = 0 if _server_answers(every) else missed + 1
        if missed >= misses and not stopping.is_set():
            _server_gone()


UPCOMING = (10.0, 20)
"""How `trnflow serve` names its deployments' scheduled runs (`upcoming_name`) where the server named
them at random: every this many seconds, the next this many waiting to start."""


def name_upcoming(names: dict[UUID, str], upcoming: int = UPCOMING[1]) -> int:
    """Give the next `upcoming` runs the server's scheduler created for these deployments (by id)
    and that wait to start the deployment's name for them (`names`); how many it renamed. A run
    created by hand (the UI's Custom run, `trnflow submit`) keeps its name."""
    waiting = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=list(names)),
                            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])))
    renamed = 0
    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True) as client:
        for run in client.read_flow_runs(flow_run_filter=waiting, sort=FlowRunSort.EXPECTED_START_TIME_ASC,
                                         limit=upcoming):
            name = names.get(run.deployment_id) if run.auto_scheduled else None
            if name and run.name != name:
                client.update_flow_run(run.id, name=name)
                renamed += 1
    return renamed


def _name_upcoming_runs(stopping: threading.Event, names: dict[UUID, str], every: float, upcoming: int) -> None:
    """Until `stopping` is set, `name_upcoming` every `every` seconds. A server that does not
    answer is `_watch_server`'s to judge: a pass that fails waits for the next."""
    while True:
        with contextlib.suppress(Exception):
            name_upcoming(names, upcoming)
        if stopping.wait(every):
            return


class _OneLine(logging.Filter):
    """Keeps a log record's message and drops its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


QUIET_TRACEBACKS = ("prefect.FlowRunCancellingObserver",)
"""Prefect loggers whose warnings about a server that went away come with a whole traceback."""


class _WhileStopping(logging.Filter):
    """Drops what asyncio reports about the tasks a stop tears down (a connection callback whose
    task was cancelled, with its traceback): expected once serving stops, and nothing to act on."""

    def __init__(self, stopping: threading.Event):
        super().__init__()
        self.stopping = stopping

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.stopping.is_set()


def _busy(exc: BaseException) -> bool:
    """Whether the server answered that it is busy (429, or a 5xx such as SQLite's locked database's
    503): worth asking again. A server that is gone does not answer at all."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    return isinstance(status, int) and (status == 429 or status >= 500)


def _pause(ids: list[Any], seconds: float) -> str:
    """Pause the deployments, each request at most `seconds`, asking again for up to twice that
    while the server answers that it is busy; what went wrong, or ''."""
    try:
        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), \
                get_client(sync_client=True, httpx_settings={"timeout": seconds}) as client:
            for deployment_id in ids:  # pausing twice is harmless
                for attempt in Retrying(stop=stop_after_delay(2 * seconds), wait=wait_exponential(0.2, max=2),
                                        retry=retry_if_exception(_busy), reraise=True):
                    with attempt:
                        client.pause_deployment(deployment_id)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


POLL_SECONDS = 2.0
"""How often serve asks the server for runs to start: a run started from the UI (or by `trnflow
submit`) leaves Scheduled within about this, where Prefect's runners wait 10 s by default."""


CANCEL_POLL_SECONDS = 10.0
"""How often the runner asks for cancelled runs once its websocket to the server has failed:
Prefect's default, whatever `POLL_SECONDS` is."""


def poll_seconds() -> float:
    """`POLL_SECONDS`, or PREFECT_RUNNER_POLL_FREQUENCY where it is set lower."""
    return min(POLL_SECONDS, get_current_settings().runner.poll_frequency)


def _cancel_polling_at_its_default() -> None:
    """Keep the runner's cancel observer polling at `CANCEL_POLL_SECONDS`. Prefect's runner gives
    it the scheduler's interval, and it polls only once its websocket has failed, that is when the
    server went away: three failures 2 s apart would print a whole traceback to serve's terminal
    before serve's own check (`GONE_CHECKS`, 20 s) says the server is gone and stops it. Private:
    `prefect.runner.runner` binds the observer's class by name (tests/unit/test_run_log.py checks
    it); where it does not, nothing changes."""
    base = getattr(runner_module, "FlowRunCancellingObserver", None)
    if base is None or getattr(base, "trnflow_cancel_polling", False):
        return

    class Observer(base):  # type: ignore[misc, valid-type]
        trnflow_cancel_polling = True

        def __init__(self, *args: Any, polling_interval: float = CANCEL_POLL_SECONDS, **kwargs: Any):
            super().__init__(*args, polling_interval=max(polling_interval, CANCEL_POLL_SECONDS), **kwargs)

    runner_module.FlowRunCancellingObserver = Observer


POLL_MISSES_SAID = 3
"""Every this many polls for scheduled runs unanswered in a row, `trnflow serve` says so in one line."""


def _unanswered(exc: BaseException) -> bool:
    """Whether a poll failed for want of an answer: no connection, a timeout, or a 5xx."""
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500


def _scheduled_polls_left_to_the_watch() -> None:
    """Make a poll for scheduled runs that goes unanswered wait for the next one. Prefect's runner
    counts them, and after three in a row (about 6 s at `POLL_SECONDS`) prints "Failed the last 3
    attempts" with each traceback and ends with an error, before serve's own check (`GONE_CHECKS`,
    20 s) could say the server is gone. Whether it is gone is `_watch_server`'s to judge; the polls
    only say, in one line, each `POLL_MISSES_SAID` misses in a row. Private: `prefect.runner.runner`
    binds the poller's class by name (tests/unit/test_run_log.py checks it); where it does not,
    nothing changes."""
    base = getattr(runner_module, "ScheduledRunPoller", None)
    if base is None or getattr(base, "trnflow_quiet_polls", False):
        return

    class Poller(base):  # type: ignore[misc, valid-type]
        trnflow_quiet_polls = True
        missed = 0

        async def _get_and_submit_flow_runs(self, *args: Any, **kwargs: Any) -> None:
            try:
                await super()._get_and_submit_flow_runs(*args, **kwargs)
            except Exception as exc:
                if not _unanswered(exc):
                    raise
                self.missed += 1
                if self.missed % POLL_MISSES_SAID == 0:
                    self._logger.warning(
                        "the Prefect server did not answer the last %d polls for scheduled runs (%s: %s); "
                        "serve asks again every %g s", self.missed, type(exc).__name__, exc, poll_seconds())
            else:
                self.missed = 0

    runner_module.ScheduledRunPoller = Poller


def serve_all(specs: list[tuple[JobSpec, str]], limit: int | None = None,
              stop_seconds: float = STOP_SECONDS) -> Stopped:
    """Serve every flow's deployment for each (spec, where it was read) from this process until
    stopped (Ctrl-C or SIGTERM), then pause them: their schedules create no runs while nothing
    serves them. Stopping takes at most `stop_seconds`, whatever the server's state. A server
    that stops answering (`GONE_CHECKS`) ends serving and this process, exit 1, saying so."""
    deadline = _Deadline(stop_seconds)
    stopping = threading.Event()

    class BoundedRunner(Runner):
        serving: asyncio.AbstractEventLoop | None = None
        """The loop `start` serves in, once it runs."""

        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            """Stop serving: cancel the runs it started (their processes get SIGTERM, which Prefect
            turns into a cancellation; each ends Cancelled), then let `start` return. Prefect's own
            handler calls `stop`, which inside the running loop only makes a coroutine that is
            never awaited: no run was cancelled. Before serving began (deployments still being
            made, each in an event loop of Prefect's own), it only says so: the deployment being
            made is finished, no other is, and serving does not begin."""
            if stopping.is_set():  # a second signal: the deadline's own handler ends it at once
                return
            stopping.set()
            deadline.arm()
            if self.serving is not None:  # the handler runs on the main thread, the loop's
                self._stopping = self.serving.create_task(self._stop_once_started())

        async def _stop_once_started(self) -> None:
            """`astop`, once `start` has connected: a signal while it is still connecting (the
            deployments exist by then) would otherwise find the runner not started, and it would
            serve on until the deadline."""
            while not self.started:
                await asyncio.sleep(0.05)
            await self.astop()

        async def serve(self) -> None:
            self.serving = asyncio.get_running_loop()
            if not stopping.is_set():
                await self.start()

    _cancel_polling_at_its_default()
    _scheduled_polls_left_to_the_watch()
    runner = BoundedRunner(pause_on_shutdown=False, limit=limit, query_seconds=poll_seconds())
    # Ctrl-C stops serving as SIGTERM does, from before the first deployment exists: one pressed
    # while they are being made pauses those made, instead of leaving them active
    signal.signal(signal.SIGINT, runner.handle_sigterm)
    os.environ[SERVED] = "1"  # the flow runs it starts leave Ctrl-C to it
    for name in QUIET_TRACEBACKS:
        logging.getLogger(name).addFilter(_OneLine())
    logging.getLogger("asyncio").addFilter(_WhileStopping(stopping))
    # from the start: a server that goes away while the deployments are being made ends serving too
    threading.Thread(target=_watch_server, args=(stopping, *GONE_CHECKS), daemon=True,
                     name="trnflow-serve-watch").start()
    ids: list = []
    names: list[str] = []
    upcoming: dict[UUID, str] = {}
    try:
        with contextlib.suppress(KeyboardInterrupt):
            for spec, source in specs:
                for entry, deployment in runner_deployments(spec, source):
                    if stopping.is_set():
                        break
                    ids.append(runner.add_deployment(deployment))
                    names.append(f"{deployment.flow_name}/{deployment.name}")
                    if deployment.schedules:
                        upcoming[ids[-1]] = upcoming_name(spec.name, entry)
            if upcoming and not stopping.is_set():
                threading.Thread(target=_name_upcoming_runs, args=(stopping, upcoming, *UPCOMING), daemon=True,
                                 name="trnflow-serve-names").start()
            asyncio.run(runner.serve())
    except Exception:
        if not stopping.is_set() and not _server_answers(GONE_CHECKS[0]):
            _server_gone()  # Prefect's runner (or a deployment being made) found it gone first
        raise
    stopping.set()
    deadline.arm()
    problem = _pause(ids, max(1.0, stop_seconds / 4))
    return Stopped(deployments=names, paused=not problem, problem=problem)
