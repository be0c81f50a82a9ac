"""`trnflow submit`, `runs`, `status`, `logs` and `cancel`: flow runs on a running Prefect server
(PREFECT_API_URL), started from its deployments (`trnflow serve` or `prefect deploy`). The talking
to the server is `trnflow.cli.server`'s; this module prints.

Exit codes scripts can rely on: 0 Completed, 1 failed (or crashed, or cancelled), 2 bad input
(including a server that is unset, unreachable or refuses the request), 3 the accuracy-parity gate
failed, 4 (`status`, and `submit --wait --timeout`) the run has not ended yet.
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
from rich.table import Table

from trnflow.cli.args import assignments
from trnflow.cli.common import load, set_overrides
from trnflow.cli.console import RED, cli_console, shown
from trnflow.cli.render import stage_table
from trnflow.errors import ExitCode
from trnflow.redact import printable
from trnflow.results import StageRow

console = cli_console()
err = cli_console(stderr=True)
STRING_PARAMS = ("run_id", "checkpoint")
"""Flow parameters that are text whatever they look like (`--param run_id=20260105` stays a string)."""
TAIL_SECONDS = 5.0
"""How long `logs --follow` keeps reading after the run ended: its last lines arrive in batches."""
LATE_LINES_SECONDS = 10.0
"""How far back each `logs --follow` read looks again, for lines that arrive out of order."""
RunArg = Annotated[str, typer.Argument(help="Flow run id (or a unique prefix of one, as `trnflow runs` shows).",
                                       show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@contextlib.contextmanager
def _server(code: int = ExitCode.BAD_INPUT) -> Iterator[Any]:
    """The connected server; its errors become one red line and exit `code`."""
    from trnflow.cli import server  # heavy: prefect's client

    try:
        with server.connect() as connected:
            yield connected
    except server.ServerError as exc:
        err.print(str(exc), **RED)
        raise typer.Exit(code) from None


def exit_code(state_type: str, state_name: str) -> int:
    if state_type == "COMPLETED":
        return 0
    return {"GateFailed": ExitCode.GATE_FAILED, "ChampionKept": ExitCode.CHAMPION_KEPT,
            "OverBudget": ExitCode.OVER_BUDGET}.get(state_name, ExitCode.FAILED)


def _parse_params(pairs: list[str] | None) -> dict[str, Any]:
    params = assignments(pairs, "--param", "run_id=nightly-1")
    for key in ("spec", "spec_url"):
        if key in params:
            err.print(f"--param {key}: submit sends SPEC whole as the run's spec; edit the file or use --set "
                      "field=value instead (a deployment's own spec_url is what its scheduled runs read)", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
    raw = {key.strip(): value.strip() for key, _, value in (pair.partition("=") for pair in pairs or [])}
    return {k: raw[k] if k in STRING_PARAMS and v is not None and not isinstance(v, str) else v
            for k, v in params.items()}


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
    timeout: Annotated[float | None, typer.Option(min=0, help="With --wait: stop waiting after this many seconds "
                                                  "and exit 4; the run goes on.", show_default=False)] = None,
    as_json: JsonOpt = False,
):
    """Start a run of a deployment on the Prefect server; print its id and UI link."""
    from trnflow.cli.server import FINAL, ui_link  # heavy: prefect's client
    from trnflow.flows.deployments import full_name  # heavy: prefect

    spec = load(spec_path, set_overrides(overrides))
    try:
        name = full_name(deployment, spec.name)
    except KeyError as exc:
        err.print(f"{exc.args[0]}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    parameters = {"spec": spec.model_dump(mode="json"), "spec_url": None, **_parse_params(params)}
    with _server() as server:
        run_id = server.start(name, parameters)
        link = ui_link(run_id)
        if not as_json:
            console.print(f"submitted [bold]{name}[/bold]: flow run {run_id}\n{link}")
        if not wait:
            if as_json:
                print(json.dumps({"id": run_id, "deployment": name, "url": link}))
            return
        with contextlib.nullcontext() if as_json else console.status("waiting") as status:
            summary = server.wait(run_id, lambda run_name, state: _waiting(status, run_name, state), timeout)
    if as_json:
        print(json.dumps({**summary, "deployment": name}, indent=2, default=str))
    else:
        _print_summary(summary)
    if summary["state_type"] not in FINAL:
        err.print(f"stopped waiting after {timeout:g} s; the run goes on: `trnflow status {run_id}`", style="yellow",
                  markup=False, highlight=False)
        raise typer.Exit(ExitCode.NOT_ENDED)
    raise typer.Exit(exit_code(summary["state_type"], summary["state"]))


def _waiting(status: Any, run_name: str, state: str) -> None:
    """Show the run's state while waiting; a run nobody picks up says what to start."""
    if status is not None:
        status.update(f"{run_name}: {state}")
    if state == "Late":
        err.print(f"{run_name} is late: nothing is running its deployment. Start `trnflow serve SPEC`, or a "
                  "worker with `prefect worker start --pool trnflow`; it starts as soon as one runs", style="yellow",
                  markup=False, highlight=False)


def _print_summary(summary: dict[str, Any]) -> None:
    colour = "green" if summary["state_type"] == "COMPLETED" else "red"
    console.print(f"[bold]{summary['name']}[/bold] ({summary['id']}): [{colour}]{summary['state']}[/{colour}]")
    if summary["message"]:
        console.print(printable(summary["message"]), markup=False, highlight=False)
    if summary.get("training"):
        console.print(f"now: {printable(summary['training'])}", markup=False, highlight=False)
    if summary["stages"]:
        console.print(stage_table([StageRow(stage=row["stage"], state=row["state"] or "", seconds=row["seconds"],
                                            summary=row["summary"] or "", device=row.get("device") or "")
                                   for row in summary["stages"]]))
    if summary["artifacts"]:
        console.print("artifacts: " + ", ".join(summary["artifacts"]))
    console.print(summary["url"])


def runs(
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many of the newest runs.")] = 20,
    as_json: JsonOpt = False,
):
    """List trnflow's flow runs on the Prefect server: those due but not started, then the newest."""
    from trnflow.cli.server import api_url  # heavy: prefect's client

    with _server() as server:
        rows = server.recent(limit)
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    table = Table("id", "name", "flow", "state", "started", "duration", title=f"trnflow runs on {api_url()}")
    for r in rows:
        started = r["started"].astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if r["started"] else ""
        table.add_row(r["id"][:8], shown(r["name"]), shown(r["flow"].removeprefix("trnflow-")), r["state"], started,
                      "" if r["seconds"] is None else f"{r['seconds']:.0f}s")
    console.print(table)


def status(run: RunArg, as_json: JsonOpt = False):
    """One run: its state, each stage's state and duration, its artifacts and UI link (exit 4 while it has not
    ended)."""
    from trnflow.cli.server import FINAL  # heavy: prefect's client

    with _server() as server:
        summary = server.summary(server.find(run))
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        _print_summary(summary)
    raise typer.Exit(exit_code(summary["state_type"], summary["state"]) if summary["state_type"] in FINAL
                     else ExitCode.NOT_ENDED)


def logs(
    run: RunArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")
                      ] = False,
):
    """Print a run's log lines (its stages' and their jobs' output), oldest first, with any terminal
    control sequence a job wrote removed."""
    from trnflow.cli.server import FINAL  # heavy: prefect's client

    with _server() as server:
        run_id, shown, since, quiet = server.find(run), set(), None, None
        while True:
            fresh = [line for line in server.logs(run_id, since) if line["id"] not in shown]
            for line in fresh:
                stamp = line["time"].astimezone(dt.UTC).strftime("%H:%M:%S")
                print(printable(f"{stamp} {line['logger'].removeprefix('prefect.')}: {line['message']}"), flush=True)
                shown.add(line["id"])
            if not follow:
                return
            if fresh:  # look back a little each time: lines from other processes can arrive late
                since = max(line["time"] for line in fresh) - dt.timedelta(seconds=LATE_LINES_SECONDS)
            if server.state(run_id)[0] in FINAL:
                quiet = time.monotonic() if fresh or quiet is None else quiet
                if time.monotonic() - quiet >= TAIL_SECONDS:  # the last batches have come in
                    return
            time.sleep(1.0)


def cancel(run: RunArg):
    """Cancel a run: its flow process is stopped, and with it the jobs it launched."""
    with _server() as server:
        run_id = server.find(run)
    with _server(ExitCode.FAILED) as server:  # an ended run, or a cancel the server declines, is a failure
        outcome = server.cancel(run_id)
    console.print(outcome)


def register(app: typer.Typer) -> None:
    for command in (submit, runs, status, logs, cancel):
        app.command()(command)
