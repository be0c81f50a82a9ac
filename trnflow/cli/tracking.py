"""`trnflow tracking`: experiment tracking. `server` starts a local MLflow tracking server for
users without one, as `trnflow server` does for Prefect."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from trnflow.cli.common import loopback_only
from trnflow.cli.console import RED, cli_console
from trnflow.errors import ExitCode

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
    a spec at it with tracking.mlflow_uri.
    """
    loopback_only(host, "this MLflow server",
                  "for a shared one use SageMaker's managed MLflow (its ARN in tracking.mlflow_uri)")
    mlflow = Path(sys.executable).with_name("mlflow")
    if not mlflow.is_file():
        found = shutil.which("mlflow")
        if found is None:
            err.print("the `mlflow` command is not installed beside trnflow: pip install 'trnflow[mlflow]'", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        mlflow = Path(found)
    folder = folder.expanduser().resolve()
    folder.mkdir(parents=True, exist_ok=True)
    local = f"[{host}]" if ":" in host else host
    url = f"http://{local}:{port}"
    console.print(f"MLflow UI and API: {url}\nin a spec: tracking:\n  mlflow_uri: {url}\nruns in "
                  f"{folder / 'mlflow.db'}, artifacts in {folder / 'artifacts'}", markup=False, highlight=False)
    env = dict(os.environ)
    env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    sys.stdout.flush()
    os.execve(mlflow, [str(mlflow), "server", "--host", host, "--port", str(port), "--workers", "1",  # noqa: S606
                       "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
                       "--artifacts-destination", str(folder / "artifacts")], env)
