"""`trnflow tracking`: experiment tracking. `server` starts a local MLflow tracking server for
users without one, as `trnflow server` does for Prefect; `sync` sends a run's mirror that its
server did not take when the run ended."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from trnflow.backends.teams import own_team
from trnflow.cli.common import JsonOpt, installed_command, loopback_only
from trnflow.cli.console import RED, cli_console
from trnflow.errors import ExitCode, TrnflowError
from trnflow.reporting import tracking
from trnflow.reporting.tracking import outbox
from trnflow.settings import TrnflowSettings
from trnflow.specs import run_id_problem

console = cli_console()
err = cli_console(stderr=True)

tracking_app = typer.Typer(help="Experiment tracking: MLflow, which runs are mirrored to (tracking.mlflow_uri).",
                           no_args_is_help=True)


@tracking_app.command()
def server(
    host: Annotated[str, typer.Option(help="Loopback address to listen on (this machine only: the server has no "
                                      "auth). For a shared server, use SageMaker's managed MLflow (its ARN in "
                                      "tracking.mlflow_uri) or one of your own behind auth.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the API and the UI.")] = 5000,
    folder: Annotated[Path, typer.Option(help="Where it keeps runs (FOLDER/mlflow.db, SQLite) and the artifacts "
                                         "it is sent (FOLDER/artifacts).")] = Path("runs/mlflow"),
):
    """Start a local MLflow tracking server (API and UI) on this machine only.

    Its runs go to SQLite (FOLDER/mlflow.db) and the artifacts it is sent to FOLDER/artifacts. Point
    a spec at it with tracking.mlflow_uri. MLflow's job runner, for its GenAI scorers, stays off
    unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true.
    """
    loopback_only(host, "this MLflow server",
                  "for a shared one use SageMaker's managed MLflow (its ARN in tracking.mlflow_uri)")
    mlflow = installed_command("mlflow", "pip install 'trnflow[mlflow]'")
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    local = f"[{host}]" if ":" in host else host
    url = f"http://{local}:{port}"
    console.print(f"MLflow UI and API: {url}\nin a spec: tracking:\n  mlflow_uri: {url}\nruns in "
                  f"{folder / 'mlflow.db'}, artifacts in {folder / 'artifacts'}", markup=False, highlight=False)
    env = dict(os.environ)
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # MLflow's job runner (its GenAI scorers' and trace roll-ups' workers, three processes that each
    # import MLflow) runs nothing trnflow sends; set the variable to true to have it anyway
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    sys.stdout.flush()
    os.execve(mlflow, [str(mlflow), "server", "--host", host, "--port", str(port), "--workers", "1",  # noqa: S606
                       "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                       "--artifacts-destination", str(folder / "artifacts")], env)


@tracking_app.command()
def sync(
    run_id: Annotated[str, typer.Argument(help="The run whose mirror was not sent (its summary says so).")],
    as_json: JsonOpt = False,
):
    """Send a run's mirror that its tracking server did not take when the run ended.

    A run keeps what it could not send in TRNFLOW_HOME/tracking/RUN_ID.json; this sends it to the
    server its spec named, then deletes it. Exit 2 when nothing is kept for RUN_ID, 1 when the
    server still does not take it (it stays kept).
    """
    home = TrnflowSettings().home.expanduser().resolve()
    if problem := run_id_problem(run_id):
        err.print(f"RUN_ID: {problem}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    kept = outbox(home, run_id)
    if not kept.is_file():
        err.print(f"nothing is kept for run {run_id} in {kept.parent}: it was sent when it ended, or never "
                  "named a tracking server", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    try:
        run = tracking.kept_run(home, run_id)
    except TrnflowError as exc:  # not a kept run: its server, or a file name, is not what a run keeps
        err.print(f"{exc}; delete it", **RED, soft_wrap=True)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    try:
        mlflow_id, url = tracking.sync(home, run, own_team(TrnflowSettings()))
    except Exception as exc:  # the server's answer, whatever the client raised
        err.print(f"run {run_id} not sent ({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); it stays in "
                  f"{kept}", **RED)
        raise typer.Exit(ExitCode.FAILED) from None
    if as_json:
        print(json.dumps({"run_id": run_id, "mlflow_run_id": mlflow_id, "url": url}))
    else:
        console.print(f"run {run_id} sent: MLflow run {mlflow_id}" + (f" ({url})" if url else ""), markup=False,
                      highlight=False)
