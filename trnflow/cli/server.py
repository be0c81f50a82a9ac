"""trnflow's flow runs on a running Prefect server (PREFECT_API_URL): start one from a deployment,
list, describe, follow, cancel. Everything comes back as plain data; an unset or unreachable
server, a refused request or an unknown run is a `ServerError` whose message says what to do."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
    FlowRunFilterStartTime,
    FlowRunFilterState,
    FlowRunFilterStateType,
    LogFilter,
    LogFilterFlowRunId,
    LogFilterTimestamp,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort, LogSort
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError
from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL
from prefect.states import Cancelling

from trnflow.flows._stages import STAGE_COLUMNS
from trnflow.flows.deployments import FLOWS

FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
LOG_PAGE = 200


class ServerError(Exception):
    """The server cannot do what was asked; the message names the fix."""


def api_url() -> str:

    url = PREFECT_API_URL.value()
    if not url:
        raise ServerError("no Prefect server: set PREFECT_API_URL, for example export "
                          "PREFECT_API_URL=http://127.0.0.1:4200/api (start one with `prefect server start`)")
    return url


def ui_link(run_id: Any) -> str:

    base = PREFECT_UI_URL.value() or api_url().removesuffix("/api")
    return f"{base.rstrip('/')}/runs/flow-run/{run_id}"


@contextlib.contextmanager
def connect() -> Iterator[Server]:
    """The server at PREFECT_API_URL, with its transport and HTTP errors turned into ServerError."""

    api = api_url()
    try:
        with get_client(sync_client=True) as client:
            yield Server(client)
    except httpx.TransportError as exc:
        raise ServerError(f"cannot reach the Prefect server at {api} ({exc}); is it running?") from None
    except PrefectHTTPStatusError as exc:
        if exc.response is not None and exc.response.status_code == 401:
            raise ServerError(f"the Prefect server at {api} asks for credentials: set PREFECT_API_AUTH_STRING to "
                              "the user:password its PREFECT_SERVER_API_AUTH_STRING names") from None
        detail = exc.response.text[:500] if exc.response is not None else str(exc)
        raise ServerError(f"the Prefect server refused the request: {detail}") from None


def _seconds(duration: dt.timedelta | None) -> float | None:
    return duration.total_seconds() if duration else None


def _stage_rows(artifacts: list[Any]) -> list[dict[str, Any]]:
    """The stage table a run attached when it ended (`<name>-stages`, with each stage's key
    figure); empty while the run is still going or when it never got that far."""

    for artifact in artifacts:
        if artifact.type == "table" and (artifact.key or "").endswith("-stages"):
            try:
                rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
                return [{field: row.get(column, "") if field == "device" else row[column]  # older runs: no device
                         for field, column in STAGE_COLUMNS.items()} for row in rows]
            except (TypeError, KeyError, ValueError):
                return []  # not a table of trnflow's
    return []


class Server:
    def __init__(self, client: Any):
        self.client = client

    def start(self, deployment: str, parameters: dict[str, Any]) -> str:
        """Create a run of `deployment` (flow/deployment) and return its id without waiting."""

        try:
            return str(run_deployment(deployment, parameters=parameters, timeout=0, as_subflow=False).id)
        except ObjectNotFound:
            raise ServerError(f"no deployment {deployment} on {api_url()}: start `trnflow serve SPEC` or run "
                              "`prefect deploy --all`, then submit again") from None

    def _recent(self, limit: int) -> list[Any]:
        """trnflow's newest flow runs that have started (not the scheduler's future ones)."""

        return self.client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[f.flow_name for f in FLOWS])),
            flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False)),
            sort=FlowRunSort.START_TIME_DESC, limit=limit)

    def _waiting(self, limit: int) -> list[Any]:
        """trnflow's runs due by now that have not started: queued, late, or waiting for a slot
        (not the scheduler's future ones)."""

        due = dt.datetime.now(dt.UTC) + dt.timedelta(minutes=1)
        return self.client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[f.flow_name for f in FLOWS])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING])),
                expected_start_time=FlowRunFilterExpectedStartTime(before_=due)),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=limit)

    def _listed(self, limit: int) -> list[Any]:
        """The runs due that have not started, then the newest that have: each once, as last read
        (one may start between the two reads)."""
        return list({r.id: r for r in self._waiting(limit) + self._recent(limit)}.values())

    def recent(self, limit: int) -> list[dict[str, Any]]:
        """The runs due that have not started, then the newest that have: `limit` in all."""
        found = self._listed(limit)[:limit]
        flows = {f.id: f.name for f in self.client.read_flows()} if found else {}
        return [{"id": str(r.id), "name": r.name, "flow": flows.get(r.flow_id, ""),
                 "state": r.state.name if r.state else "", "started": r.start_time,
                 "seconds": _seconds(r.total_run_time)} for r in found]

    def find(self, ref: str) -> str:
        """The id of the run a full id or a unique id prefix names."""

        try:
            return str(self.client.read_flow_run(uuid.UUID(ref)).id)
        except ValueError:
            pass
        except ObjectNotFound:
            raise ServerError(f"no flow run {ref} on {api_url()}") from None
        matches = [str(r.id) for r in self._listed(200) if str(r.id).startswith(ref)]
        if len(matches) != 1:
            what = "no flow run" if not matches else f"{len(matches)} flow runs"
            raise ServerError(f"{what} with an id starting {ref!r}; give more of the id (`trnflow runs` lists them)")
        return matches[0]

    def state(self, run_id: str) -> tuple[str | None, str | None, str]:
        """(state type, state name, run name)."""
        run = self.client.read_flow_run(uuid.UUID(run_id))
        return (run.state.type.value, run.state.name, run.name) if run.state else (None, None, run.name)

    def summary(self, run_id: str) -> dict[str, Any]:
        """State, each stage's state and duration, the artifacts' keys and the UI link."""

        run = self.client.read_flow_run(uuid.UUID(run_id))
        only = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
        tasks = sorted(self.client.read_task_runs(flow_run_filter=only),
                       key=lambda t: t.start_time or t.expected_start_time)
        artifacts = self.client.read_artifacts(flow_run_filter=only)
        return {
            "id": str(run.id), "name": run.name, "state": run.state.name if run.state else None,
            "state_type": run.state.type.value if run.state else None,
            "message": run.state.message if run.state else None, "url": ui_link(run.id),
            "started": run.start_time, "seconds": _seconds(run.total_run_time),
            "parameters": {k: v for k, v in run.parameters.items() if k != "spec"},
            "stages": _stage_rows(artifacts) or [
                {"stage": t.name.rsplit("-", 1)[0], "state": t.state.name if t.state else None,
                 "seconds": _seconds(t.total_run_time), "summary": ""} for t in tasks],
            "artifacts": sorted({a.key for a in artifacts if a.key}),
            "training": None if run.state and run.state.type.value in FINAL else self.training_now(run.id),
        }

    def training_now(self, run_id: uuid.UUID) -> str | None:
        """The newest training point a run logged, with the time its steps left take
        (`train: step 20/40, mean loss 0.5312, 900 samples/s, 12 s left`); None before the first."""
        only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id]))
        page = self.client.read_logs(log_filter=only, sort=LogSort.TIMESTAMP_DESC, limit=LOG_PAGE)
        return next((line.message for line in page if line.message.startswith("train: step ")), None)

    def wait(self, run_id: str, on_state: Callable[[str, str], None] | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        """Poll until the run ends, or `timeout` seconds have passed (telling `on_state` each new
        state); its summary, whose state says which."""
        last, deadline = None, None if timeout is None else time.monotonic() + timeout
        while True:
            kind, name, run_name = self.state(run_id)
            if name != last and name is not None and on_state is not None:
                on_state(run_name, name)
            last = name
            if kind in FINAL or (deadline is not None and time.monotonic() >= deadline):
                return self.summary(run_id)
            time.sleep(1.0)

    def logs(self, run_id: str, since: dt.datetime | None = None) -> list[dict[str, Any]]:
        """Every log line of the run stamped at or after `since` (all of them without), oldest first."""

        only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run_id)]),
                         timestamp=LogFilterTimestamp(after_=since) if since else None)
        lines: list[dict[str, Any]] = []
        while True:
            page = self.client.read_logs(log_filter=only, sort=LogSort.TIMESTAMP_ASC, offset=len(lines),
                                         limit=LOG_PAGE)
            lines += [{"id": str(line.id), "time": line.timestamp, "logger": line.name, "message": line.message}
                      for line in page]
            if len(page) < LOG_PAGE:
                return lines

    def cancel(self, run_id: str) -> str:
        """Ask for the run to be cancelled and say what became of it; ServerError when it has ended
        or the server declines."""

        kind, name, run_name = self.state(run_id)
        if kind in FINAL:
            raise ServerError(f"{run_name} has already ended ({name})")
        result = self.client.set_flow_run_state(uuid.UUID(run_id),
                                                Cancelling(message="cancelled from the trnflow command"))
        if result.status.value == "ACCEPT":
            return f"cancelling {run_id}"
        if result.state is not None and result.state.type.value == "CANCELLED":  # nothing was running it yet
            return f"cancelled {run_id} before it started"
        reason = getattr(result.details, "reason", None) or result.status.value.lower()
        raise ServerError(f"{run_name}: the server did not cancel it ({reason})")
