"""Experiment tracking: `trnflow tracking server` (a real MLflow server) keeps what an MLflow client
sends it in its folder, and `trnflow validate --data-check` asks a spec's tracking server whether
it answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from trnflow.cli.app import app
from trnflow.reporting.tracking import server_problem
from trnflow.workload.synth import synthesize

runner = CliRunner()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spec(tmp_path: Path) -> str:
    root = tmp_path / "data"
    synthesize(root, days=2, rows_per_day=20, seed=1)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(
        data={part: str(root / part) for part in ("train", "holdout", "inference")}, gate={"reference": None})))
    return str(path)


@pytest.mark.slow
def test_the_local_tracking_server_keeps_runs_and_artifacts_in_its_folder_and_validate_asks_it(tmp_path,
                                                                                              monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    folder, port = tmp_path / "mlflow", _free_port()
    url = f"http://127.0.0.1:{port}"
    spec = _spec(tmp_path)
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen([str(Path(sys.executable).with_name("trnflow")), "tracking", "server", "--port",
                                   str(port), "--folder", str(folder)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while server_problem(url, timeout=1)[0] is not None:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.5)
        client = MlflowClient(url)
        run = client.create_run(client.create_experiment("kept"))
        client.log_metric(run.info.run_id, "loss", 0.5, step=3)
        (tmp_path / "note.txt").write_text("sent")
        client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 0.5)]
        assert (folder / "mlflow.db").is_file()  # runs in SQLite, artifacts through the server into its folder
        assert [p.read_text() for p in (folder / "artifacts").rglob("note.txt")] == ["sent"]

        asked = runner.invoke(app, ["validate", spec, "--data-check", "--set", f"tracking.mlflow_uri={url}"])
        assert asked.exit_code == 0, asked.output
        unasked = runner.invoke(app, ["validate", spec, "--set", f"tracking.mlflow_uri={url}"])
        assert unasked.exit_code == 0 and "--data-check asks it" in unasked.stdout, unasked.output
    finally:
        server.terminate()
        server.wait(timeout=30)
    gone = runner.invoke(app, ["validate", spec, "--data-check", "--set", f"tracking.mlflow_uri={url}"])
    assert gone.exit_code == 2, gone.output
    said = " ".join(gone.stderr.split())
    assert f"tracking.mlflow_uri: no MLflow server answers at {url}" in said and "trnflow tracking server" in said
    assert "Traceback" not in gone.output


def test_the_tracking_server_listens_on_loopback_only(tmp_path):
    said = runner.invoke(app, ["tracking", "server", "--host", "0.0.0.0", "--folder", str(tmp_path / "m")])  # noqa: S104
    assert said.exit_code == 2 and "listens on loopback only" in " ".join(said.stderr.split())
    assert not (tmp_path / "m").exists()
