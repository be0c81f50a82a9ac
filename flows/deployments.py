"""The deployments of every trnflow flow for a job spec: one definition, rendered two ways.

`trnflow serve` turns them into served deployments (schedules included) in one process; `trnflow
prefect-yaml` writes them as `prefect.yaml` for `prefect deploy --all` onto a process work pool.
Each deployment is named `<spec name>-<what it runs>` (`quickstart-retrain`) and carries the whole
spec as its `spec` parameter: the UI's run form opens filled with it, and its scheduled runs run
it. Editing the spec file changes the deployments when they are served or deployed again.
The retraining deployment runs on the spec's `schedule`, one run at a time.
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

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import EntrypointType
from prefect.runner import Runner
from prefect.schedules import Cron
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_exponential

from trnflow.flows.batch_inference import batch_inference
from trnflow.flows.compile import compile_cache
from trnflow.flows.incremental_retrain import incremental_retrain
from trnflow.flows.pipeline import pipeline
from trnflow.flows.preflight import preflight
from trnflow.specs import JobSpec

WORK_POOL = "trnflow"
"""The process work pool `prefect.yaml` deploys to."""


@dataclass(frozen=True)
class FlowEntry:
    """One flow as trnflow deploys it: the flow itself, from which its name and entrypoint come."""

    key: str
    """What `trnflow submit --deployment` calls it."""
    flow: Flow[..., Any]
    description: str
    scheduled: bool = False
    suffix: str = ""
    """What the deployment's name adds to the spec's name (the key's own words by default)."""

    @property
    def flow_name(self) -> str:
        return self.flow.name

    @property
    def entrypoint(self) -> str:
        """The flow as a module path (`trnflow.flows.pipeline:pipeline`): it loads wherever trnflow is
        installed, whatever folder the worker runs in."""
        return f"{self.flow.fn.__module__}:{self.flow.fn.__name__}"

    @property
    def deployment_suffix(self) -> str:
        return self.suffix or self.key


FLOWS = (
    FlowEntry("pipeline", pipeline,
              "All six stages: sanity, collectives, compile, train, evaluate (parity gate), infer."),
    FlowEntry("preflight", preflight, "Known-answer tests on every NeuronCore, then collective tests between them."),
    FlowEntry("compile", compile_cache, "Ahead-of-time compilation into the persistent compile cache."),
    FlowEntry("incremental-retrain", incremental_retrain,
              "Retrain the champion on the days after its watermark; gate, embed, then promote.", scheduled=True,
              suffix="retrain"),
    FlowEntry("batch-inference", batch_inference, "Embed the inference set with the champion, as Parquet shards.",
              suffix="infer"),
)
BY_KEY = {f.key: f for f in FLOWS}


def deployment_name(spec_name: str, key: str) -> str:
    """`quickstart`, `incremental-retrain` -> `quickstart-retrain`: the spec's name and what the
    deployment runs, short enough for the UI's list to show whole."""
    return f"{spec_name}-{BY_KEY[key].deployment_suffix}"


def full_name(key_or_name: str, spec_name: str) -> str:
    """`pipeline` -> `trnflow-pipeline/<spec name>-pipeline`; a `flow/deployment` name is kept as it is."""
    if "/" in key_or_name:
        return key_or_name
    if key_or_name not in BY_KEY:
        raise KeyError(f"--deployment {key_or_name!r}: choose one of {', '.join(BY_KEY)}, or give flow/deployment")
    return f"{BY_KEY[key_or_name].flow_name}/{deployment_name(spec_name, key_or_name)}"


def _overlay(base: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    return {**base, **{k: _overlay(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in written.items()}}


def spec_parameter(spec: JobSpec, as_written: dict[str, Any] | None = None) -> dict[str, Any]:
    """The spec as a deployment's `spec` parameter: every field filled in, and where `as_written`
    (the file's own data) is given, its values as the file has them, so a relative location stays
    relative to the folder the flows run in."""
    filled = spec.model_dump(mode="json")
    return _overlay(filled, as_written) if as_written else filled


def definitions(spec: JobSpec, source: str, as_written: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One plain description per flow: name, entrypoint, parameters, schedules, concurrency, tags.
    `source` is where the spec was read, which each description names; `as_written`, see
    `spec_parameter`."""
    parameters = {"spec": spec_parameter(spec, as_written)}
    out = []
    for entry in FLOWS:
        item: dict[str, Any] = {
            "name": deployment_name(spec.name, entry.key), "flow_name": entry.flow_name,
            "entrypoint": entry.entrypoint, "description": f"{entry.description} Spec: {source}.",
            "parameters": parameters,
            "tags": ["trnflow", spec.name, entry.key], "schedules": [], "concurrency_limit": None,
        }
        if entry.scheduled:
            item["concurrency_limit"] = 1  # and the model's own lock, whatever starts the run
            if spec.schedule is not None:
                schedule = spec.schedule
                item["schedules"] = [{"cron": schedule.cron, "timezone": schedule.timezone}]
                item["description"] += f" Runs at `{schedule.cron}` ({schedule.timezone})."
        out.append(item)
    return out


def prefect_yaml(spec: JobSpec, source: str, as_written: dict[str, Any]) -> dict[str, Any]:
    """The `prefect.yaml` document for `prefect deploy --all` (run from the project root, whose
    folder the process worker then runs the flows in, and the spec's relative locations with them)."""
    deployments = []
    for item in definitions(spec, source, as_written):
        deployment = {
            "name": item["name"], "entrypoint": item["entrypoint"], "description": item["description"],
            "tags": item["tags"], "parameters": item["parameters"], "enforce_parameter_schema": True,
            "work_pool": {"name": WORK_POOL}, "schedules": [{**s, "active": True} for s in item["schedules"]],
        }
        if item["concurrency_limit"]:
            deployment["concurrency_limit"] = {"limit": item["concurrency_limit"], "collision_strategy": "ENQUEUE"}
        deployments.append(deployment)
    return {"name": "trnflow", "prefect-version": "3.8.8", "deployments": deployments}


def runner_deployments(spec: JobSpec, source: str) -> list[Any]:
    """The same deployments as Prefect runner deployments, for `prefect.serve`."""
    out = []
    for entry, item in zip(FLOWS, definitions(spec, source), strict=True):
        limit = item["concurrency_limit"]
        out.append(entry.flow.to_deployment(
            name=item["name"], description=item["description"], parameters=item["parameters"], tags=item["tags"],
            paused=False,  # serving again resumes what stopping paused
            entrypoint_type=EntrypointType.MODULE_PATH, enforce_parameter_schema=True,
            schedules=[Cron(s["cron"], timezone=s["timezone"]) for s in item["schedules"]],
            concurrency_limit=ConcurrencyLimitConfig(limit=limit, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
            if limit else None,
        ))
    return out


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
this many unanswered in a row. Prefect's runner gives up after three polls (about 30 s) with
tracebacks, or sometimes hangs; this ends serving first, saying why."""


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


class _OneLine(logging.Filter):
    """Keeps a log record's message and drops its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return True


QUIET_TRACEBACKS = ("prefect.FlowRunCancellingObserver",)
"""Prefect loggers whose warnings about a server that went away come with a whole traceback."""


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


def serve_all(specs: list[tuple[JobSpec, str]], limit: int | None = None,
              stop_seconds: float = STOP_SECONDS) -> Stopped:
    """Serve every flow's deployment for each (spec, where it was read) from this process until
    stopped (Ctrl-C or SIGTERM), then pause them: their schedules create no runs while nothing
    serves them. Stopping takes at most `stop_seconds`, whatever the server's state. A server
    that stops answering (`GONE_CHECKS`) ends serving and this process, exit 1, saying so."""
    deadline = _Deadline(stop_seconds)
    stopping = threading.Event()

    class BoundedRunner(Runner):
        def handle_sigterm(self, *args: Any, **kwargs: Any) -> None:
            stopping.set()
            deadline.arm()
            super().handle_sigterm(*args, **kwargs)  # cancels the runs it started, then exits

    def interrupted(*_: Any) -> None:
        stopping.set()
        deadline.arm()
        raise KeyboardInterrupt

    runner = BoundedRunner(pause_on_shutdown=False, limit=limit)
    served = [d for spec, source in specs for d in runner_deployments(spec, source)]
    ids = [runner.add_deployment(d) for d in served]
    names = [f"{d.flow_name}/{d.name}" for d in served]
    signal.signal(signal.SIGINT, interrupted)
    for name in QUIET_TRACEBACKS:
        logging.getLogger(name).addFilter(_OneLine())
    threading.Thread(target=_watch_server, args=(stopping, *GONE_CHECKS), daemon=True,
                     name="trnflow-serve-watch").start()
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        try:
            asyncio.run(runner.start())
        except Exception:
            if not stopping.is_set() and not _server_answers(GONE_CHECKS[0]):
                _server_gone()  # Prefect's runner gave up on it first
            raise
    stopping.set()
    deadline.arm()
    problem = _pause(ids, max(1.0, stop_seconds / 4))
    return Stopped(deployments=names, paused=not problem, problem=problem)
