"""`trnflow server` and `trnflow serve` as a scheduled deployment's users run them: the server's UI
finds its API on any port; the served retraining schedule fires, and its run completes through
the served process (served from the module's first test, its other tests running while the
schedule's minute comes); stopping `trnflow serve` pauses its deployments and serving again resumes
them; and with the server gone, it still stops within a bounded time, or stops by itself saying why."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prefect.states import Scheduled

from tests.integration.test_prefect_server import _job_processes
from tests.prefect_server import TRNFLOW, client_of, deployments, flow_runs, prefect_server, small_spec, wait_for
from trnflow.lifecycle.registry import Registry
from trnflow.workload.embeddings import current

pytestmark = pytest.mark.slow
RETRAIN = "trnflow-incremental-retrain/nightly-retrain"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A server of this module's own: the last test stops it."""
    with prefect_server(tmp_path_factory.mktemp("prefect-home")) as env:
        yield env


def _serve(env, spec, cwd):
    """`trnflow serve SPEC`, its output in cwd/serve.log, in a session of its own."""
    with open(cwd / "serve.log", "ab") as log:  # the child keeps its own copy of the file
        return subprocess.Popen([TRNFLOW, "serve", str(spec)], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _cron_ahead(seconds: float) -> dt.datetime:
    """The first whole minute (UTC) at least `seconds` from now."""
    at = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    return at.replace(second=0, microsecond=0) + dt.timedelta(minutes=1)


@dataclass
class Nightly:
    """`trnflow serve` of a spec whose retraining schedule is due at `due`, started when the module's
    first test asks for it, and its outputs under `root`."""

    env: dict[str, str]
    root: Path
    due: dt.datetime
    served: subprocess.Popen


@pytest.fixture(scope="module")
def nightly(server, tmp_path_factory, dataset, compile_cache):
    """Serving a spec due in a minute or two: the module's first test starts it, and its other tests
    run while the schedule's time comes (the wait is for the clock, not for work)."""
    root = tmp_path_factory.mktemp("nightly")
    due = _cron_ahead(60)  # serving starts in about 15 s, then its deployments are scheduled
    spec = small_spec(root, dataset, compile_cache, "nightly", {"cron": f"{due.minute} {due.hour} * * *",
                                                                "timezone": "UTC"})
    env = {**server, "TRNFLOW_HOME": str(root / "trnflow-home"), "TRNFLOW_POLL_SECONDS": "0.2",
           "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    served = _serve(env, spec, root)
    try:
        yield Nightly(env, root, due, served)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(served.pid, signal.SIGKILL)
        served.wait(timeout=30)


def test_the_served_retraining_schedule_creates_its_runs(nightly, server):
    """Fails where the server's scheduler cannot create runs (Prefect 3.8 with SQLAlchemy 2.1)."""
    env = nightly.env
    retrain = wait_for(lambda: deployments(env).get(RETRAIN), 120, "the served retraining deployment")

    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
    with client_of(env) as client:  # a run made by hand for later (as the UI's Custom run makes one)
        by_hand = client.create_flow_run_from_deployment(retrain.id, name="by hand", state=Scheduled(
            scheduled_time=later)).id

    # the server's scheduler creates the schedule's runs: the next few days at the cron's time, which
    # serve names for what they will run (the server named them at random)
    def scheduled():
        runs = [r for r in flow_runs(env, retrain.id) if r.state_name == "Scheduled" and r.auto_scheduled]
        return runs if len(runs) >= 2 and all(r.name == "nightly: retrain (scheduled)" for r in runs) else None

    upcoming = wait_for(scheduled, 45, f"the scheduler to create the runs of {RETRAIN} and serve to name them "
                        f"(server log: {server['PREFECT_HOME']}/server.log)")
    assert upcoming[0].expected_start_time == nightly.due
    assert upcoming[1].expected_start_time == nightly.due + dt.timedelta(days=1)
    assert {r.name for r in flow_runs(env, retrain.id) if r.id == by_hand} == {"by hand"}  # kept


def test_the_ui_of_a_server_on_any_port_talks_to_that_port(server):
    with urllib.request.urlopen(server["PREFECT_UI_URL"] + "/ui-settings", timeout=10) as answer:  # noqa: S310
        assert json.load(answer)["api_url"] == server["PREFECT_API_URL"]


def _paused(env) -> dict[str, bool]:
    with client_of(env) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {f"{flows[d.flow_id]}/{d.name}": d.paused for d in client.read_deployments()
                if d.name.startswith("stops-")}


def _answers(server) -> bool:
    try:
        with urllib.request.urlopen(server["PREFECT_API_URL"] + "/health", timeout=2):  # noqa: S310 (loopback)
            return True
    except OSError:
        return False


def test_ctrl_c_cancels_the_run_serve_was_executing_and_gives_its_model_back(server, tmp_path, dataset,
                                                                             compile_cache):
    """Ctrl-C in `trnflow serve`'s terminal (SIGINT to its process group) while a run trains: the run
    ends Cancelled, its jobs stop, its model's slot is free at once (not when its lease runs out),
    and serve prints no traceback."""
    import yaml

    from trnflow.flows._lock import limit_name

    spec = small_spec(tmp_path, dataset, compile_cache, "interrupted", {"cron": "0 3 * * *", "timezone": "UTC"})
    longer = yaml.safe_load(spec.read_text())
    longer["train"].update(steps=100_000, checkpoint_every=50_000)  # still training when Ctrl-C comes
    longer["gate"]["eval_every"] = 50_000
    spec.write_text(yaml.safe_dump(longer))
    env = {**server, "TRNFLOW_HOME": str(tmp_path / "trnflow-home"), "TRNFLOW_POLL_SECONDS": "0.2",
           "PREFECT_RUNNER_POLL_FREQUENCY": "2"}
    served = _serve(env, spec, tmp_path)
    try:
        wait_for(lambda: "trnflow-pipeline/interrupted-pipeline" in deployments(env), 120, "the served deployments")
        submitted = subprocess.run([TRNFLOW, "submit", str(spec), "--deployment", "pipeline", "--json"], env=env,
                                   capture_output=True, text=True, check=True)
        run_id = json.loads(submitted.stdout)["id"]
        wait_for(lambda: "train: step " in (tmp_path / "serve.log").read_text(), 300, "the run to train")
        began = time.monotonic()
        os.killpg(served.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its whole foreground group
        served.wait(timeout=60)
    finally:
        if served.poll() is None:
            os.killpg(served.pid, signal.SIGKILL)

    def final_state():
        with client_of(env) as client:
            run = client.read_flow_run(run_id)
        return run.state_name if run.state_type.value in ("CANCELLED", "COMPLETED", "FAILED", "CRASHED") else None

    assert wait_for(final_state, 30, "the run to end") == "Cancelled"
    assert time.monotonic() - began < 30 + 10
    with client_of(env) as client:
        limit = client.read_global_concurrency_limit_by_name(limit_name("interrupted"))
    assert limit.active_slots == 0
    wait_for(lambda: not _job_processes(tmp_path / "trnflow-home" / "jobs"), 30, "the run's jobs to stop")
    log = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log and "CancelledError" not in log, log[-3000:]
    assert "stopped: paused its 5 deployments" in " ".join(log.split())


def _stop(served, sig: int, within: float) -> int:
    """Signal `trnflow serve`, wait for it to exit, and check it took less than `within` seconds;
    its exit code."""
    began = time.monotonic()
    os.kill(served.pid, sig)
    served.wait(timeout=within + 30)  # a hang fails here
    assert time.monotonic() - began < within, f"took {time.monotonic() - began:.0f} s to stop"
    return served.returncode


def test_the_scheduled_run_fires_through_the_served_process_and_promotes_a_model(nightly):
    """The run due first (see the module's first test) runs through the served process when its
    time comes, named for the days that arrived; its model is gated, promoted and published."""
    env, root, due = nightly.env, nightly.root, nightly.due
    retrain = wait_for(lambda: deployments(env).get(RETRAIN), 120, "the served retraining deployment")

    def ended():
        due_first = [r for r in flow_runs(env, retrain.id) if r.expected_start_time == due]
        assert len(due_first) <= 1, due_first
        run = due_first[0] if due_first else None  # not scheduled yet when this test runs alone
        return run if run and run.state_type.value in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None

    try:
        seconds = (due - dt.datetime.now(dt.UTC)).total_seconds() + 600
        run = wait_for(ended, seconds, "the scheduled retraining run to end", every=2)
        log = (root / "serve.log").read_text()[-4000:]
        assert run.state_name == "Completed", f"{run.state_name}: {run.state.message}\n{log}"
        assert run.start_time >= due - dt.timedelta(seconds=15)  # a runner submits runs due within 10 s
        assert run.name == "nightly: dt=2026-01-01..2026-01-02 from scratch"  # the days that arrived
    finally:
        os.killpg(nightly.served.pid, signal.SIGKILL)
        nightly.served.wait(timeout=30)

    registry = Registry(str(root / "registry"))
    champion = registry.champion("nightly")  # gated, then promoted
    assert champion is not None and champion.watermark == "2026-01-02"
    assert [v.entry.status for v in registry.versions("nightly")] == ["passed"]
    assert current(str(root / "embeddings"))["version"] == champion.version  # its embeddings published


def test_stopping_serve_pauses_its_deployments_and_it_stops_even_with_the_server_gone(server, tmp_path, dataset,
                                                                                     compile_cache):
    spec = small_spec(tmp_path, dataset, compile_cache, "stops", {"cron": "0 3 * * *", "timezone": "UTC"})
    env = {**server, "TRNFLOW_HOME": str(tmp_path / "trnflow-home")}

    served = _serve(env, spec, tmp_path)
    wait_for(lambda: len(_paused(env)) == 5 and served.poll() is None, 120, "the served deployments")
    assert not any(_paused(env).values())
    stopped = _stop(served, signal.SIGINT, 30)  # Ctrl-C, often while its runner is still connecting
    log = (tmp_path / "serve.log").read_text()
    assert stopped == 0, log[-3000:]
    assert "stopped: paused its 5 deployments" in " ".join(log.split()) and "Traceback" not in log, log[-3000:]
    assert all(_paused(env).values())  # no schedule creates runs while nothing serves them

    served = _serve(env, spec, tmp_path)  # serving again resumes them
    wait_for(lambda: _paused(env) and not any(_paused(env).values()), 120, "the deployments to be resumed")
    (tmp_path / "left").mkdir()
    left = _serve(env, spec, tmp_path / "left")  # a second one, never signalled
    wait_for(lambda: "serving on" in (tmp_path / "left" / "serve.log").read_text(), 120, "the second serve")
    time.sleep(5)  # its runner has started polling
    os.killpg(int(server["SERVER_PID"]), signal.SIGTERM)  # the server goes away first
    wait_for(lambda: not _answers(server), 60, "the server to stop")
    assert _stop(served, signal.SIGTERM, 45) != -signal.SIGKILL  # bounded: within the 20 s it allows itself
    log = " ".join((tmp_path / "serve.log").read_text().split())
    assert any(said in log for said in ("could not pause its deployments", "did not stop within 20 s",
                                        "stopped answering, so serving stopped"))  # the last if the runner gave up
    assert "bug in trnflow" not in log

    assert left.wait(timeout=60) == 1  # four health checks 5 s apart
    log = " ".join((tmp_path / "left" / "serve.log").read_text().split())
    assert "stopped answering, so serving stopped" in log and "trnflow serve` again" in log
    assert "Traceback" not in log and "Failed the last" not in log, log[-3000:]
