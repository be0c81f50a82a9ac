"""trnflow against a real `prefect server` on 127.0.0.1 (embedded SQLite): prefect.yaml deploys
every flow onto a process work pool with the retraining schedule; `trnflow serve` serves them;
`trnflow submit --wait` runs the pipeline through a deployment and the run carries its artifacts;
`runs`, `status` and `logs` find it; `cancel` stops it and its jobs; a second retraining run waits
for the first; and the UI shows the deployment in a real browser."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.browser import browser, chromium
from tests.conftest import ROOT
from tests.prefect_server import (
    PREFECT,
    TRNFLOW,
    client_of,
    deployments,
    flow_runs,
    prefect_server,
    serving,
    small_spec,
    wait_for,
)
from trnflow.lifecycle.registry import Registry
from trnflow.specs import JobSpec

FLOW_NAMES = {"trnflow-pipeline", "trnflow-preflight", "trnflow-compile", "trnflow-incremental-retrain",
              "trnflow-batch-inference"}
SUFFIXES = {"trnflow-pipeline": "pipeline", "trnflow-preflight": "preflight", "trnflow-compile": "compile",
            "trnflow-incremental-retrain": "retrain", "trnflow-batch-inference": "infer"}


def _names(spec: str) -> set[str]:
    """Every deployment of one spec, as `flow/deployment`."""
    return {f"{flow}/{spec}-{suffix}" for flow, suffix in SUFFIXES.items()}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`prefect server start` with its own home and database; yields the environment that points at it."""
    # a run turned away by a deployment's concurrency limit is retried after this (30 s by default)
    with prefect_server(tmp_path_factory.mktemp("prefect-home"),
                        PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS="2") as env:
        yield env


def test_prefect_yaml_is_current_and_deploys_every_flow_with_the_retraining_schedule(server):
    generated = subprocess.run([TRNFLOW, "prefect-yaml"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert generated.stdout == (ROOT / "prefect.yaml").read_text(), "regenerate it: trnflow prefect-yaml > prefect.yaml"

    subprocess.run([PREFECT, "work-pool", "create", "trnflow", "--type", "process"], cwd=ROOT, env=server,
                   check=True, capture_output=True)
    deploy = subprocess.run([PREFECT, "--no-prompt", "deploy", "--all"], cwd=ROOT, env=server, capture_output=True,
                            text=True, timeout=300)
    assert deploy.returncode == 0, deploy.stdout + deploy.stderr

    deployed = {name: d for name, d in deployments(server).items() if name in _names("quickstart")}
    assert set(deployed) == _names("quickstart")  # each deployment's name says what it runs
    retrain = deployed["trnflow-incremental-retrain/quickstart-retrain"]
    assert [(s.schedule.cron, s.schedule.timezone, s.active) for s in retrain.schedules] == [("0 3 * * *", "UTC",
                                                                                              True)]
    assert retrain.global_concurrency_limit.limit == 1
    assert retrain.concurrency_options.collision_strategy.value == "ENQUEUE"  # a second run waits its turn
    assert all(d.work_pool_name == "trnflow" for d in deployed.values())
    # each carries the whole spec, every field filled in, its locations as the file has them
    written = yaml.safe_load((ROOT / "jobspecs" / "examples" / "quickstart.yaml").read_text())
    (spec,) = {json.dumps(d.parameters, sort_keys=True) for d in deployed.values()}
    spec = json.loads(spec)["spec"]
    assert set(spec) == set(JobSpec.model_fields) and spec["data"] == {**spec["data"], **written["data"]}
    assert spec["model"]["params"] == {**spec["model"]["params"], **written["model"]["params"]}
    assert not deployed["trnflow-pipeline/quickstart-pipeline"].schedules


@pytest.fixture(scope="module")
def served(server, tmp_path_factory, dataset, compile_cache):
    """`trnflow serve` on a small spec, from its own process, until the module's tests are done."""
    root = tmp_path_factory.mktemp("served")
    path = small_spec(root, dataset, compile_cache, "served", {"cron": "30 4 * * *", "timezone": "Europe/Berlin"})
    env = {**server, "TRNFLOW_HOME": str(root / "home"), "TRNFLOW_POLL_SECONDS": "0.2"}  # serve's own polling
    with serving(env, [path], cwd=root, log=root / "serve.log") as proc:
        wait_for(lambda: proc.poll() is None and _names("served") <= set(deployments(server)), 120,
                  "the served deployments")
        yield env, path, root


@pytest.mark.slow
def test_submit_runs_the_pipeline_through_the_served_deployment(served):
    env, path, root = served
    deployed = deployments(env)
    retrain = deployed["trnflow-incremental-retrain/served-retrain"]
    assert [(s.schedule.cron, s.schedule.timezone) for s in retrain.schedules] == [("30 4 * * *", "Europe/Berlin")]
    pipeline = deployed["trnflow-pipeline/served-pipeline"]
    form = pipeline.parameter_openapi_schema  # what the UI renders the run form from
    assert set(form["properties"]) == {"spec", "spec_url", "run_id", "force_promote", "lock_timeout_seconds",
                                       "override_forecast"}
    job_spec = form["properties"]["spec"]  # the JobSpec form, every section inline
    assert {"name", "model", "data", "compute", "train", "gate"} <= set(job_spec["properties"])
    assert "pattern" not in job_spec["properties"]["name"]  # patterns are the run's, which name the field and fix
    assert job_spec["properties"]["train"]["properties"]["steps"]["minimum"] == 1  # bounds, which the server enforces
    assert pipeline.enforce_parameter_schema  # by its module, wherever trnflow is installed (not a file path)
    assert pipeline.entrypoint == "trnflow.flows.pipeline.pipeline", pipeline.entrypoint
    assert "Runs at `30 4 * * *` (Europe/Berlin)." in retrain.description
    for trains in (pipeline, retrain):  # what a run is forecast to take and cost (no run yet: a guess)
        assert "Forecast: " in trains.description and "from guess." in trains.description, trains.description
    with client_of(env) as client:  # a value out of its bounds: refused as the run is created, naming the field
        bad = {**pipeline.parameters["spec"], "train": {**pipeline.parameters["spec"]["train"], "steps": -5}}
        with pytest.raises(Exception, match=r"409") as refused:
            client.create_flow_run_from_deployment(pipeline.id, parameters={"spec": bad})
        said = refused.value.response.json()["detail"]
        assert said == ("Error creating flow run: Validation failed for field 'spec.train.steps'. Failure reason: -5 "
                        "is less than the minimum of 1"), said
    # ...and opens filled with the served spec (its absolute locations: the served process runs it)
    filled = pipeline.parameters["spec"]
    assert filled["name"] == "served" and filled["train"]["steps"] == 20 and filled["model"]["params"]["d_model"] == 64
    assert filled["data"]["train"] == "file://" + yaml.safe_load(path.read_text())["data"]["train"]
    assert retrain.global_concurrency_limit.limit == 1

    done = subprocess.run([TRNFLOW, "submit", str(path), "--wait", "--json"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + (root / "serve.log").read_text()[-4000:]
    run = json.loads(done.stdout)
    assert run["state"] == "Completed" and run["deployment"] == "trnflow-pipeline/served-pipeline"
    assert run["name"] == "served: pipeline: 20 steps on 1 core, all partitions"
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
    with client_of(env) as client:  # a line a hostile job could have had logged: it sets the clipboard
        from prefect.client.schemas.actions import LogCreate

        client.create_logs([LogCreate(name="prefect.task_runs", level=20, flow_run_id=run["id"],
                                      timestamp=dt.datetime.now(dt.UTC),
                                      message="weights \x1b]52;c;Y3VybCBldmlsLnNo\x07loaded \u202eenod")])
    logs = subprocess.run([TRNFLOW, "logs", run["id"]], env=env, capture_output=True, text=True, check=True).stdout
    assert "train job" in logs and "checkpoint: step 10, url " in logs  # the jobs' events, in words
    assert '"event":' not in logs  # their JSON is in the jobs' own logs
    assert "task_runs: weights loaded \\u202eenod" in logs and "\x1b" not in logs and "Y3Vyb" not in logs


def _run_of(env, run_id: str):
    with client_of(env) as client:
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
        wait_for(lambda: _run_of(env, first).state_name == "Waiting", 120, "the first run to wait for the lock")
        second = submit()
        wait_for(lambda: _run_of(env, second).state_name == "AwaitingConcurrencySlot", 120,
                  "the second run to be held back")
        waiting = _run_of(env, first).state  # still waiting for the model's lock, and saying so
        assert waiting.name == "Waiting" and waiting.message == ("waiting: a run holds trnflow-model-served; waiting "
                                                                 "for it to end")
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

    first_run = wait_for(lambda: ended(first), 300, "the first run to end")
    second_run = wait_for(lambda: ended(second), 300, "the second run to end")
    assert (first_run.state_name, second_run.state_name) == ("Completed", "Completed")
    assert second_run.start_time >= first_run.end_time  # one after the other, never side by side


def _custom_run(page, deployment_page: str) -> None:
    """Open a deployment's Custom run form and wait until it holds the deployment's spec: the form
    draws its fields before the deployment's parameters arrive, and what is typed earlier is overwritten."""
    page.goto(deployment_page)
    page.click("Run")
    page.click("Custom run")
    page.wait_for_text("Cores Per Node")
    page.wait_for_value("Name", "served")


def _submit(page, typed: dict[str, str]) -> None:
    """Click the form's Submit until the form is sent: the page then leaves the form
    (`/deployment/<id>/run`) for the deployment's page. Before each click the `typed` fields are
    checked (and typed again if the form redrew them from the deployment's values). A click while the
    form is still checking its values is dropped without a word; a click while it is sending is
    ignored, so a second click never creates a second run."""
    for _ in range(3):
        for label, value in typed.items():
            if page.value(label) != value:
                page.fill(label, value)
        page.click("Submit")
        with contextlib.suppress(AssertionError):
            page.wait("!location.pathname.endsWith('/run')", 20, "the form to be sent")
            return
    raise AssertionError(f"three clicks on Submit sent nothing; the page says:\n{page.text()[:3000]}")


def _run_with(env, deployment_id, check):
    """The newest run of a deployment whose spec parameter passes `check`, once there is one."""
    def found():
        runs = [r for r in flow_runs(env, deployment_id) if r.parameters.get("spec") and check(r.parameters["spec"])]
        return runs[-1] if runs else None
    try:
        return wait_for(found, 60, "the run submitted from the UI")
    except AssertionError as none:
        seen = [(r.name, (r.parameters.get("spec") or {}).get("name")) for r in flow_runs(env, deployment_id)]
        raise AssertionError(f"{none}; the deployment's runs (run, spec name): {seen}") from None


def _ended(env, run_id, seconds: float):
    def final():
        run = _run_of(env, run_id)
        return run if run.state_type.value in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None
    return wait_for(final, seconds, "the run to end", every=2)


@pytest.mark.browser
def test_the_prefect_ui_as_its_users_walk_it(served, tmp_path):
    """In a real browser: the deployments, each named for what it runs; the retraining deployment's
    upcoming runs (the scheduler's); a custom run whose form opens filled with the spec, one field
    (the registry) changed and submitted, which completes with its stage table and parity chart on their pages;
    and a bad value, which fails its run with the message `trnflow validate` gives, in its log and its
    state, the run named for its spec; a value out of its bounds, which the form refuses naming the
    field, creating no run. Then the outcomes trnflow decides, each shown by name with the reason
    one click away and no traceback in its log: a run that fails the gate (`GateFailed`), one whose
    candidate passed the gate but is worse than the champion (`ChampionKept`, its evaluate stage
    passed), and a cancelled run, whose log reads as a cancellation. A run started from the UI leaves
    Scheduled within 5 s, and the run's summary fits a 1,280 px page.
    TRNFLOW_SCREENSHOTS=<folder> keeps the screenshots."""
    if chromium() is None:
        pytest.skip("Debian's chromium is not installed (make test installs it where apt-get can)")
    env, _, root = served
    shots = Path(os.environ.get("TRNFLOW_SCREENSHOTS") or tmp_path)
    ui, deployed = env["PREFECT_UI_URL"], deployments(env)
    pipeline = deployed["trnflow-pipeline/served-pipeline"]
    retrain = deployed["trnflow-incremental-retrain/served-retrain"]
    decided = DecidedRuns(env, root, registry=root / "registry-from-the-ui")  # started now, judged later
    with browser(tmp_path / "profile", width=1280) as page:
        page.goto(f"{ui}/deployments")
        for name in sorted(_names("served")):
            page.wait_for_text(name.split("/")[1])
        page.screenshot(shots / "deployments.png", full_page=False)

        page.goto(f"{ui}/deployments/deployment/{retrain.id}")
        page.click("Upcoming")
        page.wait_for_text("Scheduled for")  # the runs the server's scheduler created,
        page.wait_for_text("served: retrain (scheduled)")  # named by serve for what they will run
        page.screenshot(shots / "upcoming.png", full_page=False)

        # Custom run: the form holds the deployment's spec; one field changed, then submitted
        _custom_run(page, f"{ui}/deployments/deployment/{pipeline.id}")
        assert (page.value("Name"), page.value("Steps"), page.value("Cores Per Node")) == ("served", "20", "1")
        registry = root / "registry-from-the-ui"  # a registry of its own: the run's model becomes its champion
        page.fill("Registry Url", str(registry))
        page.screenshot(shots / "custom-run.png", full_page=False)
        _submit(page, {"Registry Url": str(registry)})
        run = _run_with(env, pipeline.id, lambda spec: spec["registry_url"] == str(registry))
        run = _ended(env, run.id, 600)
        assert run.state_name == "Completed", (run.state.message, (root / "serve.log").read_text()[-3000:])
        assert Registry(str(registry)).champion("served").version == 1  # the changed field took effect
        assert _waited_to_start(env, run.id) <= 5.0  # serve picked it up at once
        decided.champion_in_place()  # the champion the worse candidate is judged against

        page.goto(f"{ui}/runs/flow-run/{run.id}")
        page.wait_for_text("Completed")
        page.click("Artifacts")
        page.click("served-summary")
        page.wait_for_text("20 steps, loss")  # the stage list, rendered
        assert page.eval(FITS), "the summary is wider than a 1,280 px page"
        text = page.text()
        assert all(stage in text for stage in ("sanity", "collectives", "compile", "evaluate", "infer", "promote"))
        assert "file://" not in text  # local outputs are paths to copy, not links that open nothing
        page.screenshot(shots / "run-summary.png")
        page.goto(f"{ui}/runs/flow-run/{run.id}")
        page.click("Artifacts")
        page.click("served-parity")
        width = page.wait("[...document.images].filter(i => i.src.startsWith('data:image/png')).map(i => "
                          "i.naturalWidth)[0]", 30, "the parity chart to render")
        assert width > 300 and "base64" not in page.text()  # drawn, and its data not printed
        page.screenshot(shots / "parity.png", full_page=False)

        # a value the spec refuses: the run fails at once, saying which field and what to write
        def refused_run():
            _custom_run(page, f"{ui}/deployments/deployment/{pipeline.id}")
            page.fill("Name", "Quick Start")
            _submit(page, {"Name": "Quick Start"})
            return _run_with(env, pipeline.id, lambda spec: spec["name"] == "Quick Start")

        try:
            submitted = refused_run()
        except AssertionError:  # now and then the form sends the deployment's value, not the one typed: again
            submitted = refused_run()
        bad = _ended(env, submitted.id, 120)
        assert bad.state_name == "Failed"  # its message names the field first: the UI shows about 70 characters
        assert bad.state.message.startswith("name: 'Quick Start' is not allowed here; use lower-case letters, digits "
                                            "and dashes"), bad.state.message
        assert "(for example 'quick-start')" in bad.state.message and "Traceback" not in bad.state.message
        page.goto(f"{ui}/runs/flow-run/{bad.id}")  # the page opens on its log, which says why in its one line
        page.wait_for_text("name: 'Quick Start' is not allowed here")
        assert "Traceback" not in page.text(), page.text()[-6000:]
        page.screenshot(shots / "refused-log.png", full_page=False)
        page.click("Details")
        page.wait_for_text("name: 'Quick Start' is not allowed here")  # the run page's state message
        page.screenshot(shots / "refused.png", full_page=False)
        page.goto(f"{ui}/runs")
        page.wait_for_text("Quick Start: pipeline")  # named for its spec and flow, not at random
        page.screenshot(shots / "runs-list.png", full_page=False)

        # a value out of its bounds: the form names the field, and the server creates no run
        before = {r.id for r in flow_runs(env, pipeline.id)}
        redrawn = _out_of_bounds(page, env, f"{ui}/deployments/deployment/{pipeline.id}", pipeline.id, before)
        page.screenshot(shots / "form-refused.png", full_page=False)
        assert {r.id for r in flow_runs(env, pipeline.id)} == before | redrawn

        for outcome, run_id in decided.ended().items():  # GateFailed, ChampionKept, Cancelled
            _shows_its_outcome(page, env, ui, outcome, run_id, shots)


FITS = ("document.documentElement.scrollWidth <= window.innerWidth && [...document.querySelectorAll('table, li, pre, "
        "p')].every(e => e.scrollWidth <= e.clientWidth + 1)")
"""Whether the page is as wide as the window, and nothing in it cut off on the right."""


def _waited_to_start(env, run_id) -> float:
    """Seconds a run spent Scheduled before its runner picked it up (its next state, Pending)."""
    with client_of(env) as client:
        states = sorted(client.read_flow_run_states(run_id), key=lambda s: s.timestamp)
    scheduled = max(s.timestamp for s in states if s.type.value == "SCHEDULED")
    return (min(s.timestamp for s in states if s.timestamp > scheduled) - scheduled).total_seconds()


class DecidedRuns:
    """The runs whose outcome trnflow decides, through the served deployment: one that fails the
    gate (a reference it cannot reach), started at once; once the champion of `registry` is in
    place (`champion_in_place`), one worse than it on the holdout's loss (2 steps against its 20),
    and one that `ended` cancels as its first job runs. The first and the last run under names of
    their own (each name is a model of its own, whose lock no other run waits on)."""

    def __init__(self, env: dict[str, str], root: Path, registry: Path):
        self.env, self.root, self.registry = env, root, registry
        reference = root / "unreachable" / "metrics.json"
        reference.parent.mkdir()
        reference.write_text(json.dumps({"points": [{"step": 20, "accuracy": 0.999, "loss": 0.01}]}))
        self.failing = self._submit(f"gate.reference={reference}", f"registry_url={root / 'registry-gate'}",
                                    "name=served-gate")
        self.worse: subprocess.Popen | None = None
        self.cancelled: subprocess.Popen | None = None

    def _submit(self, *sets: str, wait: bool = True) -> subprocess.Popen:
        options = [arg for pair in sets for arg in ("--set", pair)]
        return subprocess.Popen([TRNFLOW, "submit", str(self.root / "served.yaml"), "--deployment",
                                 "trnflow-pipeline/served-pipeline", *options, "--json", *(["--wait"] if wait else [])],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def _run_id(proc: subprocess.Popen) -> str:
        out, err = proc.communicate(timeout=600)
        assert out.strip(), err
        return json.loads(out)["id"]

    def champion_in_place(self) -> None:
        self.worse = self._submit(f"registry_url={self.registry}", "train.steps=2", "train.checkpoint_every=2",
                                  "gate.eval_every=2", "gate.metric=loss")
        self.cancelled = self._submit("train.steps=100000", "train.checkpoint_every=50000", "gate.eval_every=50000",
                                      f"registry_url={self.root / 'registry-cancel'}", "name=served-cancel",
                                      wait=False)

    def ended(self) -> dict[str, str]:
        """Each run's id by the outcome it should end in, once each has ended."""
        assert self.worse is not None and self.cancelled is not None
        cancelled = self._run_id(self.cancelled)
        wait_for(lambda: "submitted to the" in _log_text(self.env, cancelled), 180, "the long run's first job",
                 every=2)
        subprocess.run([TRNFLOW, "cancel", cancelled], env=self.env, capture_output=True, text=True, check=True)
        ids = {"GateFailed": self._run_id(self.failing), "ChampionKept": self._run_id(self.worse),
               "Cancelled": cancelled}
        _ended(self.env, cancelled, 120)
        return ids


def _log_text(env, run_id) -> str:
    return subprocess.run([TRNFLOW, "logs", run_id], env=env, capture_output=True, text=True).stdout


def _shows_its_outcome(page, env, ui: str, outcome: str, run_id: str, shots: Path) -> None:
    """The run ended in the state named `outcome`, which its page shows, with its reason; its log (the
    page it opens on) has no traceback; the stage that decided a ChampionKept passed."""
    run = _run_of(env, run_id)
    assert run.state_name == outcome, (run.state_name, run.state.message)
    page.goto(f"{ui}/runs/flow-run/{run_id}")
    page.wait_for_text(outcome)  # the badge
    page.wait_for_text("Finished in state")  # the log, to its end
    text = page.text()
    for noise in ("Traceback", "Engine execution exited", "Crash detected", "Running()"):
        assert noise not in text, f"{outcome}: {noise!r} in its log:\n{text[-4000:]}"
    page.screenshot(shots / f"{outcome}.png", full_page=False)
    log = _log_text(env, run_id)
    if outcome == "Cancelled":
        assert "cancelled with its run" in log and "Finished in state Cancelled()" in log, log[-3000:]
        return
    page.click("Details")
    page.wait_for_text(run.state.message[:40])  # the reason, one click away
    if outcome == "GateFailed":
        assert run.state.message.startswith("accuracy -0.") and " vs metrics.json at step 20" in run.state.message
    if outcome == "ChampionKept":  # the stage passed; the run ended on what it decided
        assert run.state.message.startswith("v2 registered, not promoted: loss +0."), run.state.message
        assert "evaluate: Completed" in _task_states(env, run_id), _task_states(env, run_id)


def _task_states(env, run_id) -> str:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with client_of(env) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    return ", ".join(f"{t.name.rsplit('-', 1)[0]}: {t.state_name}" for t in tasks)


REFUSED = "-5 is less than the minimum of 1"


def _out_of_bounds(page, env, deployment_page: str, deployment_id, before: set) -> set:
    """Type -5 steps into a Custom run form and submit it, until the form refuses it naming the
    field. Now and then the form draws the deployment's values again after -5 was typed, and sends
    those: a run of the deployment's own steps (never of -5), which is cancelled, and the form is
    opened again. The ids of the runs so cancelled."""
    redrawn: set = set()
    for _ in range(3):
        _custom_run(page, deployment_page)
        page.fill("Steps", "-5")
        page.click("Submit")
        page.wait(f"document.body.innerText.includes({json.dumps(REFUSED)}) || !location.pathname.endsWith('/run')",
                  60, "the form to refuse -5 or be sent")
        if REFUSED in page.text():
            return redrawn
        sent = wait_for(lambda: [r for r in flow_runs(env, deployment_id) if r.id not in before | redrawn], 30,
                        "the run the form sent")
        assert all(r.parameters["spec"]["train"]["steps"] >= 1 for r in sent), [r.parameters for r in sent]
        for run in sent:
            cancelled = subprocess.run([TRNFLOW, "cancel", str(run.id)], env=env, capture_output=True, text=True)
            assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
            _ended(env, run.id, 120)
            redrawn.add(run.id)
    raise AssertionError(f"three forms sent the deployment's steps instead of refusing -5: {redrawn}")


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
    cancel must find the run still going, so it trains for 100,000 steps: the spec's 20 could end
    before a loaded machine has started `trnflow cancel`). Last in the module: once in a few runs,
    Prefect's runner restarts the cancelled run, cancels it again, and a SIGTERM reaches `trnflow
    serve` half a minute later, which stops it as it should; no later test then finds it serving."""
    env, path, root = served
    longer = ["--set", "train.steps=100000", "--set", "train.checkpoint_every=50000", "--set", "gate.eval_every=50000"]
    started = subprocess.run([TRNFLOW, "submit", str(path), "--deployment", "pipeline", *longer, "--json"], env=env,
                             capture_output=True, text=True, check=True)
    run_id = json.loads(started.stdout)["id"]
    jobs = root / "home" / "jobs"
    wait_for(lambda: jobs.is_dir() and _job_processes(jobs), 120, "the pipeline's first job")

    cancelled = subprocess.run([TRNFLOW, "cancel", run_id], env=env, capture_output=True, text=True)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr

    followed = subprocess.run([TRNFLOW, "logs", run_id, "--follow"], env=env, capture_output=True, text=True,
                              timeout=180)  # returns once the run has ended
    assert followed.returncode == 0 and "sanity job" in followed.stdout

    def final_state():
        shown = subprocess.run([TRNFLOW, "status", run_id, "--json"], env=env, capture_output=True, text=True)
        state = json.loads(shown.stdout)["state"]
        return state if state in ("Cancelled", "Completed", "Failed", "Crashed") else None

    assert wait_for(final_state, 120, "the run to end") == "Cancelled"
    wait_for(lambda: not _job_processes(jobs), 60, "the run's jobs to stop")
    again = subprocess.run([TRNFLOW, "cancel", run_id], env=env, capture_output=True, text=True)
    assert again.returncode == 1 and "already ended (Cancelled)" in " ".join(again.stderr.split())
