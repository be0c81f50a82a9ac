"""`trnflow plan` on the real history: two quickstart runs keep what they measured beside the
registry, and the forecast of a third rests on exactly those measurements."""

from __future__ import annotations

import datetime as dt
import json

import pytest
import yaml
from typer.testing import CliRunner

from trnflow.cli.app import app
from trnflow.reporting.history import history

runner = CliRunner()


@pytest.mark.slow
def test_the_forecast_of_a_run_rests_on_what_the_runs_before_it_measured(prefect_api, make_spec, tmp_path,
                                                                         trnflow_home):
    from trnflow.flows.pipeline import pipeline

    steps = {"first": 10, "second": 20}
    outcomes = {}
    for run_id, count in steps.items():  # no reference: what the gate compares is not what it measures
        spec = make_spec(1, train={"steps": count, "checkpoint_every": 10, "log_every": 5},
                         gate={"eval_every": 10, "reference": None})
        outcomes[run_id] = pipeline(spec, run_id=run_id, force_promote="the test measures it, whatever its accuracy")
    records, unread = history(spec, trnflow_home)
    assert unread == [] and [r.run_id for r in records] == ["first", "second"]
    for record in records:  # the measurements are the run's own
        outcome, train = outcomes[record.run_id], record.stage("train")
        trained = outcome.results["train"]  # the steady step's rate: the first step's graph is the fixed part's
        assert train.rate == round(spec.train.global_batch_size / trained.median_step_seconds, 3) > 0
        assert train.work == steps[record.run_id] * spec.train.global_batch_size
        assert [s.stage for s in record.stages] == [row.stage for row in outcome.stages if row.state == "Completed"]
        assert {s.stage: s.seconds for s in record.stages} == {
            row.stage: row.seconds for row in outcome.stages if row.state == "Completed"}

    path = tmp_path / "third.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    said = runner.invoke(app, ["plan", str(path), "--set", "train.steps=40", "--json"])
    assert said.exit_code == 0, said.output
    forecast = json.loads(said.stdout)
    train = next(s for s in forecast["stages"] if s["stage"] == "train")
    expected = sorted(max(0.0, m.seconds - m.work / m.rate) + 40 * spec.train.global_batch_size / m.rate
                      for m in (r.stage("train") for r in records))
    assert train["source"] == "history" and (train["low"], train["high"]) == (
        pytest.approx(expected[0], abs=0.06), pytest.approx(expected[1], abs=0.06))
    assert [s["stage"] for s in forecast["stages"]] == [s.stage for s in records[-1].stages]
    assert forecast["seconds"] == pytest.approx(sum(s["seconds"] for s in forecast["stages"]), abs=0.1)
    compiled = next(s for s in forecast["stages"] if s["stage"] == "compile")  # the first run's programs, cached
    assert compiled["source"] == "checked" and compiled["basis"].startswith(
        "the compile cache (the programs an earlier compile recorded): 0 of "), compiled
    text = runner.invoke(app, ["plan", str(path), "--calibrate"])  # history on this layout: no job needed
    assert text.exit_code == 0 and "forecast: " in text.stdout and "from checked, history" in text.stdout, text.output
    assert "--calibrate: not needed, earlier runs on this layout measured it" in text.stderr
    checked = runner.invoke(app, ["validate", str(path), "--json"])  # validate's one line
    notes = json.loads(checked.stdout)[0]["notes"]
    assert checked.exit_code == 0 and any(n.startswith("forecast: ") and "from history" in n for n in notes), notes


@pytest.mark.slow
def test_a_budget_stops_training_checkpointed_a_deadline_warns_early_and_a_higher_budget_resumes(
        prefect_api, make_spec, tmp_path, trnflow_home):
    from prefect.client.orchestration import get_client

    from trnflow.errors import OverBudget
    from trnflow.flows.pipeline import pipeline
    from trnflow.workload.checkpoint import step_name

    # $100,000 an instance-hour: one cent is spent long before the first logged step (10 of 40)
    spec = make_spec(1, compute={"price_per_hour": 100_000}, gate={"reference": None},  # the gate is not the subject
                     train={"max_cost_usd": 0.01, "max_minutes": 0.0001, "checkpoint_every": 20, "log_every": 10})
    refused = pipeline(spec, run_id="refused", return_state=True)
    assert refused.name == "Failed" and "refused before its first job" in refused.message
    assert "train.max_minutes: training is forecast to take" in refused.message
    assert "train.max_cost_usd: training is forecast to cost" in refused.message
    assert not (tmp_path / "checkpoints" / "refused").exists()  # no job ran

    stopped = pipeline(spec, run_id="budget", override_forecast="the test spends past it on purpose",
                       return_state=True)
    assert stopped.name == "OverBudget", stopped.message
    failure = stopped.result(raise_on_failure=False)
    assert failure.stage == "train" and isinstance(failure.cause, OverBudget)
    assert "over its budget of $0.0100 (train.max_cost_usd, or what compute.max_cost_usd leaves for training): " \
        "training stopped after step 10" in str(failure.cause)
    run_dir = tmp_path / "checkpoints" / "budget"
    assert (run_dir / step_name(10) / "meta.json").is_file()  # checkpointed where it stopped
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(stopped.state_details.flow_run_id)
    late = [s for s in states if s.name == "DeadlineAtRisk"]
    assert late and "after its deadline of 0.0001 min (train.max_minutes)" in late[0].message  # said while it ran
    assert states.index(late[0]) < len(states) - 1 and states[-1].name == "OverBudget"

    spent = make_spec(1, compute={"price_per_hour": 100_000, "max_cost_usd": 0.01},  # gone by the preflight
                      gate={"reference": None})
    before = pipeline(spent, run_id="spent", override_forecast="the test spends past it", return_state=True)
    assert before.name == "OverBudget" and "nothing is left of the budget for training" in before.message
    assert [(r.stage, r.state) for r in before.result(raise_on_failure=False).stages][-1] == ("train", "Failed")
    assert not any((tmp_path / "checkpoints" / "spent" / step_name(s)).exists() for s in (10, 20, 40))  # untrained

    higher = make_spec(1, compute={"price_per_hour": 100_000}, gate={"reference": None},
                       train={"max_cost_usd": 1_000_000, "checkpoint_every": 20, "log_every": 10})
    outcome = pipeline(higher, run_id="budget", override_forecast="the test resumes it",
                       force_promote="the test resumes it, whatever its accuracy")
    train = outcome.results["train"]
    assert train.start_step == 10 and train.resumed_from.endswith(step_name(10)) and train.steps_trained == 30


@pytest.mark.slow
def test_a_calibration_times_steps_of_the_real_program_where_no_run_measured_the_layout(make_spec, tmp_path,
                                                                                         trnflow_home):
    spec = make_spec(1, train={"steps": 200})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True)))
    said = runner.invoke(app, ["plan", str(path), "--calibrate", "--json"])
    assert said.exit_code == 0, said.output
    forecast = json.loads(said.stdout)
    train = next(s for s in forecast["stages"] if s["stage"] == "train")
    assert train["source"] == "calibrated" and train["basis"] == "20 timed steps of the real program on this layout"
    assert 0 < train["low"] < train["seconds"] < train["high"]
    compiled = next(s for s in forecast["stages"] if s["stage"] == "compile")  # the cache was asked
    assert compiled["source"] == "checked" and compiled["basis"].startswith("compile --check: "), compiled
    assert {s["source"] for s in forecast["stages"] if s["stage"] not in ("train", "compile")} == {"guess"}
    assert "checking the compile cache " in said.stderr
    assert "calibrated: 20 steps in " in said.stderr  # a real job ran, through the local backend
    assert not (tmp_path / "checkpoints").exists()  # and kept nothing of the spec's


def test_status_of_a_running_run_shows_its_newest_training_point_and_its_late_state(prefect_api):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import LogCreate
    from prefect.states import Running

    from trnflow.cli.server import Server

    @flow(name="status-probe")
    def probe() -> None:
        pass

    with get_client(sync_client=True) as client:
        run = client.create_flow_run(probe)
        late = "training is forecast to end 3.0 min after its start, after its deadline of 2 min"
        client.set_flow_run_state(run.id, Running(name="DeadlineAtRisk", message=late), force=True)
        said = ["data: files 2", "train: step 10/40, mean loss 0.6000, 800 samples/s, 30 s left",
                "train: step 20/40, mean loss 0.5000, 900 samples/s, 12 s left", "checkpoint: step 20"]
        now = dt.datetime.now(dt.UTC)
        client.create_logs([LogCreate(name="prefect.task_runs", level=20, message=m, flow_run_id=run.id,
                                      timestamp=now + dt.timedelta(seconds=i)) for i, m in enumerate(said)])
        summary = Server(client).summary(str(run.id))
    assert summary["state"] == "DeadlineAtRisk" and "after its deadline of 2 min" in summary["message"]
    assert summary["training"] == "train: step 20/40, mean loss 0.5000, 900 samples/s, 12 s left"
