"""Experiment tracking: `trnflow tracking server` (a real MLflow server) keeps what an MLflow client
sends it in its folder; `trnflow validate --data-check` asks a spec's tracking server whether it
answers; a pipeline run is mirrored there as trnflow recorded it, and a run that found the server
down ends green, keeps its mirror, and `trnflow tracking sync` sends it once the server is back;
the registry's versions are MLflow model versions whose `champion` alias follows trnflow's champion;
`tensorboard --logdir` shows each run's event files."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.browser import browser, chromium
from tests.conftest import quickstart_data
from tests.process_tree import command_line, descendants
from trnflow.cli.app import app
from trnflow.lifecycle.registry import Registry, RegistryEntry
from trnflow.reporting.tensorboard import logdir
from trnflow.reporting.tracking import HEADER_LOGGER, server_problem
from trnflow.storage import local_path
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


@contextlib.contextmanager
def tracking_server(folder: Path, port: int, log: Path) -> Iterator[str]:
    """`trnflow tracking server` in a process of its own, once it answers: its URL. Stopped after."""
    with open(log, "ab") as out:
        server = subprocess.Popen([str(Path(sys.executable).with_name("trnflow")), "tracking", "server", "--port",
                                   str(port), "--folder", str(folder)], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while server_problem(url, timeout=1)[0] is not None:
            assert server.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
def test_the_local_tracking_server_keeps_runs_and_artifacts_in_its_folder_and_validate_asks_it(tmp_path,
                                                                                              monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    folder, port = tmp_path / "mlflow", _free_port()
    url = f"http://127.0.0.1:{port}"
    spec = _spec(tmp_path)
    with tracking_server(folder, port, tmp_path / "server.log"):
        client = MlflowClient(url)
        run = client.create_run(client.create_experiment("kept"))
        client.log_metric(run.info.run_id, "loss", 0.5, step=3)
        (tmp_path / "note.txt").write_text("sent")
        client.log_artifact(run.info.run_id, str(tmp_path / "note.txt"))
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 0.5)]
        assert (folder / "mlflow.db").is_file()  # runs in SQLite, artifacts through the server into its folder
        assert [p.read_text() for p in (folder / "artifacts").rglob("note.txt")] == ["sent"]
        started = [command_line(pid) for pid in descendants(os.getpid())]
        assert not [c for c in started if b"huey" in c or b"mlflow.server.jobs" in c]  # no job runner

        asked = runner.invoke(app, ["validate", spec, "--data-check", "--set", f"tracking.mlflow_uri={url}"])
        assert asked.exit_code == 0, asked.output
        unasked = runner.invoke(app, ["validate", spec, "--set", f"tracking.mlflow_uri={url}"])
        assert unasked.exit_code == 0 and "--data-check asks it" in unasked.stdout, unasked.output
    gone = runner.invoke(app, ["validate", spec, "--data-check", "--set", f"tracking.mlflow_uri={url}"])
    assert gone.exit_code == 2, gone.output
    said = " ".join(gone.stderr.split())
    assert f"tracking.mlflow_uri: no MLflow server answers at {url}" in said and "trnflow tracking server" in said
    assert "Traceback" not in gone.output


def test_the_tracking_server_listens_on_loopback_only(tmp_path):
    said = runner.invoke(app, ["tracking", "server", "--host", "0.0.0.0", "--folder", str(tmp_path / "m")])  # noqa: S104
    assert said.exit_code == 2 and "listens on loopback only" in " ".join(said.stderr.split())
    assert not (tmp_path / "m").exists()


def _mlflow_run(client, experiment: str, run_id: str):
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                               filter_string=f"tags.`trnflow.run_id` = '{run_id}'")
    assert len(found) == 1, found
    return found[0]


def _series(client, mlflow_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in sorted(client.get_metric_history(mlflow_id, key), key=lambda m: m.step)]


def _alias(url: str, model: str) -> int:
    """trnflow's version that MLflow's `champion` alias names."""
    from mlflow import MlflowClient

    return int(MlflowClient(url).get_model_version_by_alias(model, "champion").tags["trnflow.version"])


def _mirrored_as(url: str, model: str, version: int) -> str:
    from mlflow import MlflowClient

    found = MlflowClient(url).search_model_versions(f"name = '{model}' and tags.`trnflow.version` = '{version}'")
    assert len(found) == 1, found
    return found[0].version


@contextlib.contextmanager
def tensorboard_server(logdir: str, port: int, log: Path) -> Iterator[str]:
    """`tensorboard --logdir` in a process of its own, once it has read the folder: its URL."""
    with open(log, "ab") as out:
        server = subprocess.Popen([str(Path(sys.executable).with_name("tensorboard")), "--logdir", logdir,
                                   "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "1"],
                                  stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/data/runs", timeout=2) as answer:  # noqa: S310
                if json.loads(answer.read()):
                    break
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def _board_series(board: str, run: str, tag: str) -> list[tuple[int, float]]:
    query = urllib.parse.urlencode({"run": run, "tag": tag})
    with urllib.request.urlopen(f"{board}/data/plugin/scalars/scalars?{query}", timeout=10) as answer:  # noqa: S310
        return [(step, value) for _, step, value in json.loads(answer.read())]


@pytest.mark.slow
@pytest.mark.browser
def test_a_run_is_mirrored_to_mlflow_and_one_that_found_it_down_is_synced_later(
        prefect_api, make_spec, tmp_path, trnflow_home, monkeypatch):
    from mlflow import MlflowClient

    from trnflow.backends.reference import run_reference
    from trnflow.flows.pipeline import pipeline
    from trnflow.workload.memory import decided

    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setattr(logging.getLogger(HEADER_LOGGER), "level", logging.ERROR)  # the plugin's, on a plain URL
    folder, port = tmp_path / "mlflow", _free_port()
    url = f"http://127.0.0.1:{port}"
    spec = make_spec(1, tracking={"mlflow_uri": url, "experiment": "search/m5", "tensorboard": True},
                     train={"steps": 20, "checkpoint_every": 10, "log_every": 5}, gate={"eval_every": 10})
    run_reference(spec)
    with tracking_server(folder, port, tmp_path / "server.log"):
        state = pipeline(spec, run_id="mirrored", return_state=True)
        assert state.is_completed(), state.result(raise_on_failure=False)
        outcome = state.result()
        client = MlflowClient(url)
        run = _mlflow_run(client, "search/m5", "mirrored")
        assert run.info.status == "FINISHED" and run.info.run_name == "mirrored"
        params, tags = run.data.params, run.data.tags
        assert (params["train.steps"], params["model.recipe"], params["compute.cores_per_node"]) == ("20", "m5-text",
                                                                                                    "1")
        # the spec as the run ran it: its layout decided
        assert tags["trnflow.spec_digest"] == decided(spec).digest() and params["train.parallelism.strategy"] == "ddp"
        assert tags["trnflow.gate"] == "passed" and tags["trnflow.state"] == "Completed"
        assert tags["trnflow.checkpoint"] == outcome.results["train"].checkpoint
        trained = tags["trnflow.stage.train"]
        assert trained.startswith("Completed in ") and " on emulator: " in trained
        assert {k.removeprefix("trnflow.stage.") for k in tags if k.startswith("trnflow.stage.")} == {
            row.stage for row in outcome.stages}
        assert tags["trnflow.flow_run"].startswith(prefect_api.removesuffix("/api"))
        # the series are trnflow's own, at the same steps
        curve = outcome.results["train"].curve
        assert _series(client, run.info.run_id, "train/loss") == [(p.step, pytest.approx(p.loss)) for p in curve]
        evaluated = outcome.results["evaluate"]
        assert _series(client, run.info.run_id, "eval/accuracy") == [
            (p.step, pytest.approx(p.value("accuracy"))) for p in evaluated.points]
        assert _series(client, run.info.run_id, "reference/accuracy") == [
            (p.step, pytest.approx(p.reference)) for p in evaluated.verdict.points] and len(evaluated.points) == 2
        assert _series(client, run.info.run_id, "infer/rows") == [(0, outcome.results["infer"].rows)]
        assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"summary.md", "outcome.json", "parity.png",
                                                                            "registry"}
        chart = Path(client.download_artifacts(run.info.run_id, "parity.png", str(tmp_path)))
        assert chart.read_bytes() == local_path(evaluated.chart).read_bytes()
        # the registered version, by reference, and the champion alias on it
        version = evaluated.registry.version
        champion = client.get_model_version_by_alias(spec.name, "champion")
        assert champion.tags["trnflow.version"] == str(version) and champion.run_id == run.info.run_id
        assert champion.source == f"runs:/{run.info.run_id}/registry/v{version:06d}"
        entry = RegistryEntry.model_validate_json(Path(client.download_artifacts(
            run.info.run_id, f"registry/v{version:06d}/entry.json", str(tmp_path))).read_text())
        assert entry.checkpoint == outcome.results["train"].checkpoint and entry.tracking == url
        assert Registry(spec.registry_url).version(spec.name, version).entry == entry
        assert not (trnflow_home / "tracking").exists() or not any((trnflow_home / "tracking").iterdir())

    # the server is down: the run (a longer one: a second version, gated without a reference, which
    # nothing here reads) ends green, says so in its summary, and keeps its mirror
    spec = make_spec(1, tracking={"mlflow_uri": url, "experiment": "search/m5", "tensorboard": True},
                     train={"steps": 30, "checkpoint_every": 10, "log_every": 5},
                     gate={"eval_every": 10, "reference": None})
    state = pipeline(spec, run_id="missed", return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    kept = trnflow_home / "tracking" / "missed.json"
    assert kept.is_file()
    with tracking_server(folder, port, tmp_path / "server.log"):  # back, with what it held
        assert _mlflow_run(MlflowClient(url), "search/m5", "mirrored").info.status == "FINISHED"
        said = runner.invoke(app, ["tracking", "sync", "missed", "--json"])
        assert said.exit_code == 0, said.output
        sent = json.loads(said.stdout)
        mlflow_id = sent["mlflow_run_id"]
        assert sent["url"].startswith(f"{url}/#/experiments/") and sent["url"].endswith(f"/runs/{mlflow_id}")
        synced = _mlflow_run(MlflowClient(url), "search/m5", "missed")
        assert synced.info.run_id == mlflow_id and synced.info.status == "FINISHED"
        curve = state.result().results["train"].curve
        assert [s for s, _ in _series(MlflowClient(url), mlflow_id, "train/loss")] == [p.step for p in curve]
        assert not kept.exists()
        # MLflow's alias follows trnflow's champion, whichever run made it, and every change of it
        registry = Registry(spec.registry_url)
        assert _alias(url, spec.name) == registry.champion(spec.name).version
        other = ({1, 2} - {registry.champion(spec.name).version}).pop()
        for command, expected in ((["promote", spec.name, str(other)], other), (["rollback", spec.name], 3 - other)):
            moved = runner.invoke(app, ["models", *command, "--registry", spec.registry_url, "--json"])
            assert moved.exit_code == 0, moved.output
            assert json.loads(moved.stdout)["tracking"] == [
                f"MLflow's {spec.name}@champion is version {_mirrored_as(url, spec.name, expected)} "
                f"(trnflow v{expected})"]
            assert _alias(url, spec.name) == expected == registry.champion(spec.name).version
        walked = _walk_the_mlflow_ui(url, _mlflow_run(MlflowClient(url), "search/m5", "mirrored"), tmp_path)
    again = runner.invoke(app, ["tracking", "sync", "missed"])
    assert again.exit_code == 2 and "nothing is kept for run missed" in " ".join(again.stderr.split())
    # a change of champion while the server is down stands; the alias is moved by the next mirror
    down = runner.invoke(app, ["models", "promote", spec.name, str(other), "--registry", spec.registry_url])
    assert down.exit_code == 0 and Registry(spec.registry_url).champion(spec.name).version == other, down.output
    assert f"MLflow's {spec.name}@champion on {url} not moved" in " ".join(down.stdout.split())

    # TensorBoard shows each run's event files under the checkpoint folder, trnflow's series at its steps
    with tensorboard_server(logdir(spec.train.checkpoint_url), _free_port(), tmp_path / "tensorboard.log") as board:
        for run_id, ran in (("mirrored", outcome), ("missed", state.result())):
            assert _board_series(board, f"{run_id}/tensorboard", "train/loss") == [
                (p.step, pytest.approx(p.loss, rel=1e-6)) for p in ran.results["train"].curve]
            assert _board_series(board, f"{run_id}/tensorboard", "eval/accuracy") == [
                (p.step, pytest.approx(p.value("accuracy"), rel=1e-6)) for p in ran.results["evaluate"].points]
    if not walked:
        pytest.skip("all but the MLflow UI's walk passed: Debian's chromium is not installed (make test installs it)")


def _walk_the_mlflow_ui(url: str, run, tmp_path: Path) -> bool:
    """In a real browser: the run's page in MLflow's UI, its metrics charts drawn (the training
    loss, the candidate's and the reference's accuracy, the gate's difference). Whether a browser
    was there to do it. TRNFLOW_SCREENSHOTS=<folder> keeps the screenshot."""
    if chromium() is None:
        return False
    shots = Path(os.environ.get("TRNFLOW_SCREENSHOTS") or tmp_path)
    with browser(tmp_path / "profile") as page:
        page.goto(f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}")
        page.wait_for_text("Model metrics")
        page.goto(f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics")  # the tab
        search = "input[placeholder='Search metric charts']"
        for query, series in (("loss", ("train/loss", "eval/loss")), ("diff", ("gate/diff",)),
                              ("accuracy", ("eval/accuracy", "reference/accuracy"))):
            page.type_into(search, query)
            for key in series:  # a chart's legend: the run and the series it draws
                page.wait_for_text(f"mirrored ({key})")
            page.wait(f"document.querySelectorAll('.js-plotly-plot').length >= {len(series)}", 60, "the charts")
        page.screenshot(shots / "mlflow-run.png", full_page=False)  # the parity gate's two series
    return True


@pytest.mark.slow
def test_a_run_that_failed_is_kept_as_failed_when_no_server_answers(tmp_path):
    from trnflow.reporting.tracking import TrackedRun, mirror, outbox
    from trnflow.results import RunOutcome, StageRow
    from trnflow.specs import validate_spec
    from trnflow.teams import UNDECLARED

    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    spec = validate_spec(quickstart_data(tracking={"mlflow_uri": url}))
    outcome = RunOutcome(run_id="failed-1", stages=[StageRow(stage="sanity", state="Failed", summary="core 1 bad")])
    sent, note = mirror(spec, outcome, "stage sanity failed: core 1 bad", "# summary", None, tmp_path, UNDECLARED)
    assert not sent and note.startswith(f"tracking: not sent to {url} (") and "tracking sync failed-1" in note
    kept = TrackedRun.model_validate_json(outbox(tmp_path, "failed-1").read_text())
    assert not kept.finished and kept.tags["trnflow.state"] == "stage sanity failed: core 1 bad"
    assert kept.experiment == "quickstart" and kept.params["train.steps"] == str(spec.train.steps)
    assert kept.artifacts["summary.md"] == "# summary" and "faults" not in " ".join(kept.params)


@pytest.mark.slow
def test_a_sagemaker_arn_is_reached_through_the_sagemaker_mlflow_plugin(tmp_path, monkeypatch):
    """The ARN is handed to the plugin, which routes the client's requests to SageMaker's MLflow
    endpoint for the ARN's region (not reachable here: the run's mirror is kept)."""
    from trnflow.reporting.tracking import mirror, outbox
    from trnflow.results import RunOutcome, StageRow
    from trnflow.specs import validate_spec
    from trnflow.teams import UNDECLARED

    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    arn = "arn:aws:sagemaker:eu-west-1:123456789012:mlflow-tracking-server/search"
    spec = validate_spec(quickstart_data(tracking={"mlflow_uri": arn}))
    outcome = RunOutcome(run_id="arn-1", stages=[StageRow(stage="sanity", state="Completed", summary="2 cores")])
    sent, note = mirror(spec, outcome, None, "# summary", None, tmp_path, UNDECLARED)
    assert not sent and "https://eu-west-1.experiments.sagemaker.aws/api/2.0/mlflow/" in note, note
    assert outbox(tmp_path, "arn-1").is_file()
