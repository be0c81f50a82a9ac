"""trnflow against a real `prefect server` on 127.0.0.1 (embedded SQLite): prefect.yaml deploys
every flow onto a process work pool with the retraining schedule; `trnflow serve` serves them;
`trnflow submit --wait` runs the pipeline through a deployment and the run carries its artifacts;
`runs`, `status` and `logs` find it; `cancel` stops it and its jobs; a second retraining run waits
for the first; and the UI shows the deployment in a real browser."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

TRNFLOW = str(Path(sys.executable).with_name("trnflow"))
PREFECT = str(Path(sys.executable).with_name("prefect"))
FLOW_NAMES = {"trnflow-pipeline", "trnflow-preflight", "trnflow-compile", "trnflow-incremental-retrain",
              "trnflow-batch-inference"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(check, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`prefect server start` with its own home and database; yields the environment that points at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_URL": f"http://127.0.0.1:{port}",
           # a run turned away by a deployment's concurrency limit is retried after this (30 s by default)
           "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2"}
    log = open(home / "server.log", "wb")  # noqa: SIM115 (closed at teardown)
    proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env={**env, "PREFECT_LOGGING_LEVEL": "WARNING"},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as answer:  # noqa: S310 (loopback)
                return answer.status == 200
        except OSError:
            assert proc.poll() is None, (home / "server.log").read_text()
            return False

    _wait_for(healthy, 120, "the Prefect server")
    yield env
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    log.close()


@contextlib.contextmanager
def _client(env):
    """A Prefect client of the test server, whatever API this process otherwise uses."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        yield client


def _deployments(env) -> dict:
    with _client(env) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {f"{flows[d.flow_id]}/{d.name}": d for d in client.read_deployments()}


def test_prefect_yaml_is_current_and_deploys_every_flow_with_the_retraining_schedule(server):
    generated = subprocess.run([TRNFLOW, "prefect-yaml"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert generated.stdout == (ROOT / "prefect.yaml").read_text(), "regenerate it: trnflow prefect-yaml > prefect.yaml"

    subprocess.run([PREFECT, "work-pool", "create", "trnflow", "--type", "process"], cwd=ROOT, env=server,
                   check=True, capture_output=True)
    deploy = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=ROOT, env=server, capture_output=True,
                            text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr

    deployed = {name: d for name, d in _deployments(server).items() if name.endswith("/quickstart")}
    assert {name.split("/")[0] for name in deployed} == FLOW_NAMES
    retrain = deployed["trnflow-incremental-retrain/quickstart"]
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in retrain.schedules] == [("0 3 * * *", "UTC",
                                                                                              True)]
    assert retrain.global_concurrency_limit.limit == 1
    assert retrain.concurrency_options.collision_strategy.value == "ENQUEUE"  # a second run waits its turn
    assert all(d.work_pool_name == "trnflow" for d in deployed.values())
    assert all(d.parameters == {"spec_url": "jobspecs/examples/quickstart.yaml"} for d in deployed.values())
    assert not deployed["trnflow-pipeline/quickstart"].schedules


@pytest.fixture(scope="module")
def served(server, tmp_path_factory, dataset, compile_cache):
    """`trnflow serve` on a small spec, from its own process, until the module's tests are done."""
    root = tmp_path_factory.mktemp("served")
    spec = yaml.safe_load((ROOT / "jobspecs" / "examples" / "quickstart.yaml").read_text())
    spec.update(
        name="served",
        data={"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
              "inference": str(dataset / "inference"), "format": "jsonl"},
        compute={**spec["compute"], "cores_per_node": 1},  # one rank a job: these tests are about serving
        train={**spec["train"], "steps": 20, "checkpoint_every": 10, "log_every": 10, "global_batch_size": 16,
               "checkpoint_url": str(root / "checkpoints")},
        compile={**spec["compile"], "cache_url": str(compile_cache)},
        gate={"reference": None, "eval_every": 10},
        inference={**spec["inference"], "output_url": str(root / "embeddings"), "shard_size": 200},
        registry_url=str(root / "registry"),
        schedule={"cron": "30 4 * * *", "timezone": "Europe/Berlin"},
    )
    path = root / "served.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**server, "TRNFLOW_HOME": str(root / "home"), "TRNFLOW_POLL_SECONDS": "0.2",
           "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    log = open(root / "serve.log", "wb")  # noqa: SIM115 (closed at teardown)
    proc = subprocess.Popen([TRNFLOW, "serve", str(path)], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    _wait_for(lambda: proc.poll() is None and {f"{f}/served" for f in FLOW_NAMES} <= set(_deployments(server)),
              120, "the served deployments")
    yield env, path, root
    os.killpg(proc.pid, signal.SIGKILL)  # nothing of it is needed any more
    proc.wait(timeout=30)
    log.close()


@pytest.mark.slow
def test_submit_runs_the_pipeline_through_the_served_deployment(served):
    env, path, root = served
    deployed = _deployments(env)
    retrain = deployed["trnflow-incremental-retrain/served"]
    assert [(s.schedule.cron, s.schedule.timezone) for s in retrain.schedules] == [("30 4 * * *", "Europe/Berlin")]
    form = deployed["trnflow-pipeline/served"].parameter_openapi_schema  # what the UI renders the run form from
    assert set(form["properties"]) == {"spec", "spec_url", "run_id", "force_promote", "lock_timeout_seconds"}
    assert {"name", "model", "data", "compute", "train", "gate"} <= set(form["definitions"]["JobSpec"]["properties"])
    assert retrain.global_concurrency_limit.limit == 1

    done = subprocess.run([TRNFLOW, "submit", str(path), "--wait", "--json"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + (root / "serve.log").read_text()[-4000:]
    run = json.loads(done.stdout)
    assert run["state"] == "Completed" and run["deployment"] == "trnflow-pipeline/served"
    assert run["name"] == "served: all partitions"
    assert [s["stage"] for s in run["stages"]] == ["sanity", "collectives", "compile", "train", "evaluate", "infer",
                                                   "promote"]
    figures = {s["stage"]: s["summary"] for s in run["stages"]}  # each stage's key figure, from the stages table
    assert re.match(r"all \d+ cores passed", figures["sanity"]) and figures["train"].startswith("20 steps, loss ")
    assert figures["infer"].startswith("350 embeddings") and figures["collectives"].startswith("one core: no ")
    assert {s["stage"]: s["device"] for s in run["stages"]}["train"] == "emulator"  # which device each job ran on
    assert {f"served-{k}" for k in ("summary", "stages", "sanity", "compile", "training", "gate",
                                    "parity", "embeddings")} <= set(run["artifacts"])
    assert run["url"].endswith(f"/runs/flow-run/{run['id']}")
    assert (root / "embeddings" / "v000001" / "_manifest.json").is_file()  # the served process ran it, for real
    assert (root / "embeddings" / "_current.json").is_file()

    listed = json.loads(subprocess.run([TRNFLOW, "runs", "--json"], env=env, capture_output=True, text=True,
                                       check=True).stdout)
    assert run["id"] in {r["id"] for r in listed}
    status = subprocess.run([TRNFLOW, "status", run["id"][:8], "--json"], env=env, capture_output=True, text=True)
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "Completed"
    logs = subprocess.run([TRNFLOW, "logs", run["id"]], env=env, capture_output=True, text=True, check=True).stdout
    assert "train job" in logs and '"event": "checkpoint"' in logs


def _job_processes(jobs: Path) -> list[int]:
    """The processes of the local jobs under `jobs`: each job's supervisor and launcher (its process
    group, named by pid.json), and its ranks (whose command lines name the job's folder)."""
    found = []
    for pid_file in jobs.glob("*/pid.json"):
        group = json.loads(pid_file.read_text())["pid"]
        try:
            os.killpg(group, 0)
            found.append(group)
        except ProcessLookupError:
            pass
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(jobs).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_cancel_stops_the_run_and_the_jobs_it_launched(served):
    """The pipeline's run, cancelled as its first job starts (the pipeline, not just the preflight: its
    cancel must find the run still going)."""
    env, path, root = served
    started = subprocess.run([TRNFLOW, "submit", str(path), "--deployment", "pipeline", "--json"], env=env,
                             capture_output=True, text=True, check=True)
    run_id = json.loads(started.stdout)["id"]
    jobs = root / "home" / "jobs"
    _wait_for(lambda: jobs.is_dir() and _job_processes(jobs), 120, "the pipeline's first job")

    cancelled = subprocess.run([TRNFLOW, "cancel", run_id], env=env, capture_output=True, text=True)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr

    followed = subprocess.run([TRNFLOW, "logs", run_id, "--follow"], env=env, capture_output=True, text=True,
                              timeout=180)  # returns once the run has ended
    assert followed.returncode == 0 and "sanity job" in followed.stdout

    def final_state():
        shown = subprocess.run([TRNFLOW, "status", run_id, "--json"], env=env, capture_output=True, text=True)
        state = json.loads(shown.stdout)["state"]
        return state if state in ("Cancelled", "Completed", "Failed", "Crashed") else None

    assert _wait_for(final_state, 120, "the run to end") == "Cancelled"
    _wait_for(lambda: not _job_processes(jobs), 60, "the run's jobs to stop")
    again = subprocess.run([TRNFLOW, "cancel", run_id], env=env, capture_output=True, text=True)
    assert again.returncode == 1 and "already ended (Cancelled)" in " ".join(again.stderr.split())


def _run_of(env, run_id: str):
    with _client(env) as client:
        return client.read_flow_run(run_id)


@pytest.mark.slow
def test_a_second_retraining_run_waits_for_the_first_to_end(served):
    """Another retraining of the model holds its lock (a run started elsewhere, here this test):
    the first submitted run waits for the lock, holding the deployment's one slot, and the
    second waits for that slot, so the two never run at once and both complete in turn."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from trnflow.flows._lock import model_lock

    env, path, _ = served

    def submit() -> str:
        started = subprocess.run([TRNFLOW, "submit", str(path), "--deployment", "incremental-retrain", "--json"],
                                 env=env, capture_output=True, text=True, check=True)
        return json.loads(started.stdout)["id"]

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), model_lock("served", timeout_seconds=60):
        first = submit()
        _wait_for(lambda: _run_of(env, first).state_name == "Running", 120, "the first run to start")
        second = submit()
        _wait_for(lambda: _run_of(env, second).state_name == "AwaitingConcurrencySlot", 120,
                  "the second run to be held back")
        assert _run_of(env, first).state_name == "Running"  # still waiting for the model's lock
        still = subprocess.run([TRNFLOW, "status", first[:8]], env=env, capture_output=True, text=True)
        assert still.returncode == 4  # not ended yet

        # one too many: waited for a little, then cancelled while it waits, found by its prefix
        waited = subprocess.run([TRNFLOW, "submit", str(path), "--deployment", "incremental-retrain", "--wait",
                                 "--timeout", "2", "--json"], env=env, capture_output=True, text=True)
        assert waited.returncode == 4 and "stopped waiting after 2 s" in waited.stderr
        third = json.loads(waited.stdout)["id"]
        listed = json.loads(subprocess.run([TRNFLOW, "runs", "--json"], env=env, capture_output=True, text=True,
                                           check=True).stdout)
        assert {first, second, third} <= {r["id"] for r in listed}
        cancelled = subprocess.run([TRNFLOW, "cancel", third[:8]], env=env, capture_output=True, text=True)
        assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
        assert "before it started" in cancelled.stdout and _run_of(env, third).state_name == "Cancelled"

    def ended(run_id):
        run = _run_of(env, run_id)
        return run if run.state_type.value in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    first_run = _wait_for(lambda: ended(first), 300, "the first run to end")
    second_run = _wait_for(lambda: ended(second), 300, "the second run to end")
    assert (first_run.state_name, second_run.state_name) == ("Completed", "Completed")
    assert second_run.start_time >= first_run.end_time  # one after the other, never side by side


@pytest.mark.browser
def test_the_ui_shows_the_deployment(served, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (make test installs it where apt-get can)")
    env, _, _ = served
    deployment = _deployments(env)["trnflow-incremental-retrain/served"]
    page = f"{env['PREFECT_UI_URL']}/deployments/deployment/{deployment.id}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=15000", "--window-size=1400,1000"]
    shot = tmp_path / "deployment.png"
    subprocess.run([chromium, *flags, f"--screenshot={shot}", page], capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dom = subprocess.run([chromium, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "served" in dom and "trnflow-incremental-retrain" in dom
