"""`trnflow submit`, `runs`, `status`, `logs` and `cancel`: flow runs on a running Prefect server
(PREFECT_API_URL), started from its deployments (`trnflow serve` or `prefect deploy`).

Exit codes scripts can rely on: 0 Completed, 1 failed (or crashed, or cancelled), 2 bad input,
3 the accuracy-parity gate failed.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

console = Console()
err = Console(stderr=True)
EXIT_FAILED, EXIT_BAD_INPUT, EXIT_GATE = 1, 2, 3
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
RunArg = Annotated[str, typer.Argument(help="Flow run id (or a unique prefix of one, as `trnflow runs` shows).",
                                       show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


def _api() -> str:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        err.print("[red]no Prefect server: set PREFECT_API_URL, for example "
                  "export PREFECT_API_URL=http://127.0.0.1:4200/api (start one with `prefect server start`)[/red]")
        raise typer.Exit(EXIT_BAD_INPUT)
    return url


@contextlib.contextmanager
def _client() -> Iterator[Any]:
    """A client of the server at PREFECT_API_URL; an unreachable server or a refused request is a
    one-line error, not a traceback."""
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    api = _api()
    try:
        with get_client(sync_client=True) as client:
            yield client
    except httpx.TransportError as exc:
        err.print(f"[red]cannot reach the Prefect server at {api} ({exc}); is it running?[/red]")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except PrefectHTTPStatusError as exc:
        detail = exc.response.text[:500] if exc.response is not None else str(exc)
        err.print(f"[red]the Prefect server refused the request: {detail}[/red]", markup=False, highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


def ui_link(run_id: Any) -> str:
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value() or _api().removesuffix("/api")
    return f"{base.rstrip('/')}/runs/flow-run/{run_id}"


def exit_code(state_type: str, state_name: str) -> int:
    if state_type == "COMPLETED":
        return 0
    return EXIT_GATE if state_name == "GateFailed" else EXIT_FAILED


def _resolve(client: Any, run: str):
    """The flow run a full id or a unique id prefix names."""
    import uuid

    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_flow_run(uuid.UUID(run))
    except ValueError:
        pass
    except ObjectNotFound:
        err.print(f"[red]no flow run {run} on {_api()}[/red]")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    matches = [r for r in _recent(client, 200) if str(r.id).startswith(run)]
    if len(matches) != 1:
        what = "no flow run" if not matches else f"{len(matches)} flow runs"
        err.print(f"[red]{what} with an id starting {run!r}; give more of the id (`trnflow runs` lists them)[/red]")
        raise typer.Exit(EXIT_BAD_INPUT)
    return matches[0]


def _recent(client: Any, limit: int) -> list[Any]:
    """trnflow's newest flow runs that have started (not the scheduler's future ones)."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName, FlowRunFilter, FlowRunFilterStartTime
    from prefect.client.schemas.sorting import FlowRunSort

    from flows.deployments import FLOWS

    return client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[f.flow_name for f in FLOWS])),
        flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(is_null_=False)),
        sort=FlowRunSort.START_TIME_DESC, limit=limit)


def _parse_params(pairs: list[str] | None) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            err.print(f"[red]--param {pair!r}: expected NAME=VALUE, for example --param run_id=nightly-1[/red]")
            raise typer.Exit(EXIT_BAD_INPUT)
        out[key.strip()] = yaml.safe_load(value)
    return out


def _seconds(run: Any) -> float | None:
    if run.total_run_time:
        return run.total_run_time.total_seconds()
    return None


def submit(
    spec_path: Annotated[Path, typer.Argument(help="Job spec YAML file; sent whole as the run's `spec`.",
                                              show_default=False)],
    deployment: Annotated[str, typer.Option(help="pipeline, preflight, compile, incremental-retrain, "
                                            "batch-inference, or a full flow/deployment name.")] = "pipeline",
    params: Annotated[list[str] | None, typer.Option("--param", help="Another flow parameter: "
                                                     "--param run_id=nightly-1 (repeatable; value parsed as YAML).")
                      ] = None,
    overrides: Annotated[list[str] | None, typer.Option("--set", help="Override a spec field: --set train.steps=50.")
                         ] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Wait for the run to end, then exit with its outcome.")
                    ] = False,
    as_json: JsonOpt = False,
):
    """Start a run of a deployment on the Prefect server; print its id and UI link."""
    from prefect.deployments import run_deployment

    from flows.deployments import full_name
    from trnflow.cli import _load, _overrides

    spec = _load(spec_path, _overrides(overrides))
    try:
        name = full_name(deployment, spec.name)
    except KeyError as exc:
        err.print(f"[red]{exc.args[0]}[/red]")
        raise typer.Exit(EXIT_BAD_INPUT) from None
    parameters = {"spec": spec.model_dump(mode="json"), "spec_url": None, **_parse_params(params)}
    from prefect.exceptions import ObjectNotFound

    with _client():  # for its handling of an unreachable server or refused parameters
        try:
            run = run_deployment(name, parameters=parameters, timeout=0, as_subflow=False)
        except ObjectNotFound:
            err.print(f"[red]no deployment {name} on {_api()}: start `trnflow serve {spec_path}` or run "
                      "`prefect deploy --all`, then submit again[/red]")
            raise typer.Exit(EXIT_BAD_INPUT) from None
    link = ui_link(run.id)
    if not as_json:
        console.print(f"submitted [bold]{name}[/bold]: flow run {run.id}\n{link}")
    if not wait:
        if as_json:
            print(json.dumps({"id": str(run.id), "deployment": name, "url": link}))
        return
    with _client() as client:
        final = _wait(client, run.id, quiet=as_json)
        summary = _summary(client, final)
    if as_json:
        print(json.dumps({**summary, "deployment": name}, indent=2, default=str))
    else:
        _print_summary(summary)
    raise typer.Exit(exit_code(summary["state_type"], summary["state"]))


def _wait(client: Any, run_id: Any, quiet: bool) -> Any:
    import contextlib

    last = None
    with contextlib.nullcontext() if quiet else console.status("waiting") as status:
        while True:
            run = client.read_flow_run(run_id)
            if run.state and run.state.name != last and status is not None:
                last = run.state.name
                status.update(f"{run.name}: {last}")
            if run.state and run.state.type.value in FINAL:
                return run
            time.sleep(1.0)


def _summary(client: Any, run: Any) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    only = FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))
    tasks = sorted(client.read_task_runs(flow_run_filter=only), key=lambda t: t.start_time or t.expected_start_time)
    artifacts = client.read_artifacts(flow_run_filter=only)
    return {
        "id": str(run.id), "name": run.name, "state": run.state.name if run.state else None,
        "state_type": run.state.type.value if run.state else None,
        "message": run.state.message if run.state else None, "url": ui_link(run.id),
        "started": run.start_time, "seconds": _seconds(run), "parameters": {
            k: v for k, v in run.parameters.items() if k != "spec"},
        "stages": [{"stage": t.name.rsplit("-", 1)[0], "state": t.state.name if t.state else None,
                    "seconds": t.total_run_time.total_seconds() if t.total_run_time else None} for t in tasks],
        "artifacts": sorted({a.key for a in artifacts if a.key}),
    }


def _print_summary(summary: dict[str, Any]) -> None:
    colour = "green" if summary["state_type"] == "COMPLETED" else "red"
    console.print(f"[bold]{summary['name']}[/bold] ({summary['id']}): [{colour}]{summary['state']}[/{colour}]")
    if summary["message"]:
        console.print(summary["message"], markup=False, highlight=False)
    if summary["stages"]:
        table = Table("stage", "state", "duration")
        for row in summary["stages"]:
            table.add_row(row["stage"], row["state"] or "", "" if row["seconds"] is None else f"{row['seconds']:.1f}s")
        console.print(table)
    if summary["artifacts"]:
        console.print("artifacts: " + ", ".join(summary["artifacts"]))
    console.print(summary["url"])


def runs(
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many of the newest runs.")] = 20,
    as_json: JsonOpt = False,
):
    """List the newest trnflow flow runs that have started on the Prefect server."""
    with _client() as client:
        found = _recent(client, limit)
        flows = {f.id: f.name for f in client.read_flows()} if found else {}
    rows = [{"id": str(r.id), "name": r.name, "flow": flows.get(r.flow_id, ""),
             "state": r.state.name if r.state else "", "started": r.start_time, "seconds": _seconds(r)}
            for r in found]
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    table = Table("id", "name", "flow", "state", "started", "duration", title=f"trnflow runs on {_api()}")
    for r in rows:
        started = r["started"].astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if r["started"] else ""
        table.add_row(r["id"][:8], r["name"], r["flow"].removeprefix("trnflow-"), r["state"], started,
                      "" if r["seconds"] is None else f"{r['seconds']:.0f}s")
    console.print(table)


def status(run: RunArg, as_json: JsonOpt = False):
    """One run: its state, each stage's state and duration, its artifacts and UI link."""
    with _client() as client:
        summary = _summary(client, _resolve(client, run))
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_summary(summary)
    if summary["state_type"] in FINAL:
        raise typer.Exit(exit_code(summary["state_type"], summary["state"]))


def logs(
    run: RunArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")
                      ] = False,
):
    """Print a run's log lines (its stages' and their jobs' output), oldest first."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    with _client() as client:
        flow_run = _resolve(client, run)
        seen = 0
        while True:
            page = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run.id])),
                                    sort=LogSort.TIMESTAMP_ASC, offset=seen, limit=200)
            for line in page:
                stamp = line.timestamp.astimezone(dt.UTC).strftime("%H:%M:%S")
                print(f"{stamp} {line.name.removeprefix('prefect.')}: {line.message}")
            seen += len(page)
            if len(page) == 200:
                continue
            if not follow:
                return
            state = client.read_flow_run(flow_run.id).state
            if state and state.type.value in FINAL:
                follow = False  # one more read for the last lines
                continue
            time.sleep(1.0)


def cancel(run: RunArg):
    """Cancel a run: its flow process is stopped, and with it the jobs it launched."""
    from prefect.states import Cancelling

    with _client() as client:
        flow_run = _resolve(client, run)
        if flow_run.state and flow_run.state.type.value in FINAL:
            err.print(f"[red]{flow_run.name} has already ended ({flow_run.state.name})[/red]")
            raise typer.Exit(EXIT_FAILED)
        result = client.set_flow_run_state(flow_run.id, Cancelling(message="cancelled from the trnflow command"))
    if result.status.value != "ACCEPT":
        reason = getattr(result.details, "reason", None) or result.status.value.lower()
        err.print(f"[red]{flow_run.name}: the server did not cancel it ({reason})[/red]")
        raise typer.Exit(EXIT_FAILED)
    console.print(f"cancelling {flow_run.name} ({flow_run.id})")


def register(app: typer.Typer) -> None:
    for command in (submit, runs, status, logs, cancel):
        app.command()(command)
