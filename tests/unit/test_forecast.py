"""The forecast of a run's time and cost from the runs before it (`trnflow.reporting.forecast`)."""

from __future__ import annotations

import json
import logging

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from trnflow.cli.app import app  # the command's modules load torch lazily, in the tests that run it
from trnflow.errors import OverBudget
from trnflow.events import readable
from trnflow.records import TrainTime
from trnflow.reporting.budget import over_daily_spend, over_limits, training_budget
from trnflow.reporting.cost import job_cost, price_per_hour, run_cost
from trnflow.reporting.forecast import beside, plan
from trnflow.reporting.goodput import goodput
from trnflow.reporting.history import RunShape, history, keep, record_of
from trnflow.reporting.ledger import JobLedger, LedgerEntry
from trnflow.reporting.report import cost_markdown
from trnflow.results import CompileResult, CostRow, InferResult, RunOutcome, StageRow, TrainResult
from trnflow.specs import validate_spec
from trnflow.tasks.train import _budget_left


def _spec(tmp_path, steps: int = 100, train: dict | None = None, **compute):
    return validate_spec(quickstart_data(train={"steps": steps, "global_batch_size": 32,
                                                "parallelism": {"strategy": "ddp"}, **(train or {})},
                                         compute={"cores_per_node": 2, **compute},
                                         registry_url=str(tmp_path / "registry")))


def _outcome(run_id: str, steps: int, rate: float, fixed: float, rows: int = 1000, rows_per_s: float = 500.0):
    """A completed run whose training took `fixed` seconds plus its samples at `rate`."""
    samples = steps * 32
    rows_seconds = 2.0 + rows / rows_per_s
    stages = [StageRow(stage="sanity", state="Completed", seconds=3.0),
              StageRow(stage="compile", state="Completed", seconds=20.0),
              StageRow(stage="train", state="Completed", seconds=fixed + samples / rate),
              StageRow(stage="evaluate", state="Completed", seconds=1.0),
              StageRow(stage="infer", state="Completed", seconds=rows_seconds)]
    results = {"train": TrainResult(checkpoint="x", steps_trained=steps, samples_per_s=rate),
               "infer": InferResult(output_url="o", rows=rows, rows_embedded=rows, rows_per_s=rows_per_s, shards=[])}
    return RunOutcome(run_id=run_id, stages=stages, results=results)


def test_a_run_kept_in_the_history_is_read_back_beside_its_registry(tmp_path):
    spec = _spec(tmp_path)
    where = keep(spec, _outcome("r1", 100, 400.0, 10.0), tmp_path / "home")
    assert where == f"{spec.registry_url}/quickstart/history/r1.json"
    (records, unread) = history(spec, tmp_path / "home")
    assert unread == [] and [r.run_id for r in records] == ["r1"]
    train = records[0].stage("train")
    assert (train.work, train.rate) == (3200.0, 400.0) and records[0].layout == RunShape.of(spec)
    (tmp_path / "registry" / "quickstart" / "history" / "torn.json").write_text("{")
    records, unread = history(spec, tmp_path / "home")
    assert [r.run_id for r in records] == ["r1"] and unread == ["torn.json: ValidationError"]


@pytest.mark.parametrize("change", [
    {"cost_usd": float("nan")},  # a NaN spot share would pass every budget check
    {"on_demand_usd": float("inf")},
    {"layout": {"cores_per_node": 0}},  # a zero would divide the forecast by zero
    {"layout": {"nodes": -1}},
    {"stages": [{"stage": "train", "seconds": float("nan")}]},
    {"stages": [{"stage": "[link=https://evil.example]train[/link]", "seconds": 1.0}]},
    {"layout": {"instance_type": "trn1\x1b]52;c;cm0gLXJmIH4=\x07"}},  # OSC 52: a write to the clipboard
])
def test_a_record_with_a_number_or_name_no_run_measures_is_unreadable_and_left_out(tmp_path, change):
    spec = _spec(tmp_path)
    keep(spec, _outcome("good", 100, 400.0, 10.0), tmp_path / "home")
    folder = tmp_path / "registry" / "quickstart" / "history"
    planted = json.loads((folder / "good.json").read_text())
    for key, value in change.items():
        planted[key] = {**planted[key], **value} if isinstance(value, dict) else value
    planted["run_id"] = "planted"
    (folder / "planted.json").write_text(json.dumps(planted))
    records, unread = history(spec, tmp_path / "home")
    assert [r.run_id for r in records] == ["good"] and unread == ["planted.json: ValidationError"]
    forecast = plan(spec, records)
    assert forecast.cost_usd is not None and forecast.cost_usd == forecast.cost_usd  # finite, not NaN


def test_training_is_forecast_as_its_fixed_part_plus_the_samples_at_the_measured_rate(tmp_path):
    runs = [record_of(_spec(tmp_path, 100), _outcome("a", 100, 400.0, 10.0), at=1),
            record_of(_spec(tmp_path, 200), _outcome("b", 200, 500.0, 14.0), at=2)]
    spec = _spec(tmp_path, 300)
    forecast = plan(spec, runs, now=1000.0)
    train = next(s for s in forecast.stages if s.stage == "train")
    by_run = [10.0 + 9600 / 400.0, 14.0 + 9600 / 500.0]
    assert train.source == "history" and train.seconds == pytest.approx(sum(by_run) / 2, abs=0.1)
    assert (train.low, train.high) == (pytest.approx(min(by_run), abs=0.1), pytest.approx(max(by_run), abs=0.1))
    infer = next(s for s in forecast.stages if s.stage == "infer")
    assert infer.seconds == pytest.approx(4.0, abs=0.1)  # 2 s fixed and 1000 rows at 500 rows/s
    assert [s.stage for s in forecast.stages] == ["sanity", "compile", "train", "evaluate", "infer"]
    assert forecast.seconds == pytest.approx(sum(s.seconds for s in forecast.stages))
    assert forecast.finish_at == pytest.approx(1000.0 + forecast.seconds)
    hourly = price_per_hour(spec)
    assert train.cost_usd == pytest.approx(hourly * spec.compute.nodes * train.seconds / 3600, abs=1e-4)
    assert next(s for s in forecast.stages if s.stage == "evaluate").cost_usd == 0.0  # no instances
    assert "from history" in forecast.headline()


def test_another_layouts_rate_is_scaled_by_the_cores_and_marked_so(tmp_path):
    runs = [record_of(_spec(tmp_path, 100), _outcome("a", 100, 400.0, 10.0), at=1)]
    spec = _spec(tmp_path, 100, instance_type="trn1.32xlarge", cores_per_node=8)
    train = next(s for s in plan(spec, runs).stages if s.stage == "train")
    assert train.source == "scaled" and "scaled by cores" in train.basis
    assert train.seconds == pytest.approx(10.0 + 3200 / (400.0 * 4), abs=0.1)
    assert train.low < train.seconds < train.high


def test_without_history_every_figure_is_a_stated_guess(tmp_path):
    forecast = plan(_spec(tmp_path), [])
    assert {s.source for s in forecast.stages} == {"guess"} and forecast.notes
    assert [s.stage for s in forecast.stages] == ["sanity", "collectives", "compile", "train", "evaluate", "infer",
                                                  "promote"]
    assert all("guess" in s.basis for s in forecast.stages)


def test_a_run_that_trained_nothing_leaves_no_record(tmp_path):
    outcome = RunOutcome(run_id="idle", stages=[StageRow(stage="train", state="Completed", seconds=1.0)],
                         results={"train": TrainResult(checkpoint=None, skipped=True, reason="no new data")})
    assert keep(_spec(tmp_path), outcome, tmp_path / "home") is None
    assert history(_spec(tmp_path), tmp_path / "home") == ([], [])


@pytest.mark.slow  # builds the recipe's model to decide its layout
def test_trnflow_plan_prints_the_forecast_and_refuses_a_bad_spec_with_exit_2(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(registry_url=str(tmp_path / "registry"))))
    said = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert said.exit_code == 0, said.output
    forecast = json.loads(said.stdout)
    assert {s["source"] for s in forecast["stages"]} == {"guess"} and forecast["layout"]["strategy"] != "auto"
    folder = tmp_path / "registry" / "quickstart" / "history"
    folder.mkdir(parents=True)  # a record another run planted, whose name would write to the clipboard (OSC 52)
    (folder / "[bold]x\x1b]52;c;cm0gLXJmIH4=\x07.json").write_text("{}")
    shown = CliRunner().invoke(app, ["plan", str(path)])
    assert shown.exit_code == 0 and "\x1b" not in shown.output, shown.output
    assert "left out of the history (unreadable): [bold]x.json: ValidationError" in shown.stderr
    bad = CliRunner().invoke(app, ["plan", str(path), "--set", "train.steps=0"])
    assert bad.exit_code == 2 and "train.steps" in bad.stderr and "Traceback" not in bad.output


def test_a_run_forecast_past_its_deadline_or_budget_is_named_field_by_field(tmp_path):
    runs = [record_of(_spec(tmp_path, 100), _outcome("a", 100, 400.0, 10.0), at=1)]
    within = _spec(tmp_path, 100, train={"max_minutes": 1.0, "max_cost_usd": 1.0}, max_cost_usd=1.0)
    forecast = plan(within, runs)
    train = next(s for s in forecast.stages if s.stage == "train")
    assert train.seconds == pytest.approx(18.0, abs=0.1) and over_limits(within, forecast) == []

    late = _spec(tmp_path, 100, train={"max_minutes": 0.25})  # 15 s: training takes 18
    assert over_limits(late, plan(late, runs)) == [
        "train.max_minutes: training is forecast to take 18 s (history: 1 run(s) on this layout), past its "
        "deadline of 0.25 min"]
    costly = _spec(tmp_path, 100, max_cost_usd=0.001)
    found = plan(costly, runs)
    assert over_limits(costly, found) == [
        f"compute.max_cost_usd: the run is forecast to cost ${found.cost_usd:.4f} on demand (from history; `trnflow "
        "plan` has each stage's), over its budget of $0.0010"]
    capped = _spec(tmp_path, 100, train={"max_cost_usd": 0.001})
    assert over_limits(capped, plan(capped, runs))[0].startswith("train.max_cost_usd: training is forecast to cost $")
    budget = _spec(tmp_path, 100, max_cost_usd=100.0)  # ml.trn2.48xlarge has no price in the catalogue
    unpriced = budget.model_copy(update={"compute": budget.compute.model_copy(
        update={"backend": "sagemaker", "instance_type": "trn2.48xlarge"})})
    assert over_limits(unpriced, plan(unpriced, runs)) == [
        "compute.max_cost_usd: no price is known for trn2.48xlarge on sagemaker, so the budget cannot be held; set "
        "compute.price_per_hour"]
    assert over_limits(late, None) and over_limits(_spec(tmp_path), None) == []  # no forecast: fails closed


def test_training_may_spend_the_budget_less_what_was_spent_and_what_comes_after_it(tmp_path):
    runs = [record_of(_spec(tmp_path, 100), _outcome("a", 100, 400.0, 10.0), at=1)]
    spec = _spec(tmp_path, 100, max_cost_usd=1.0)
    forecast = plan(spec, runs)
    after = sum(s.cost_usd for s in forecast.stages[[s.stage for s in forecast.stages].index("train") + 1:])
    assert after > 0  # inference holds the instances
    allowance, basis = training_budget(spec, forecast, spent_usd=0.25)
    assert allowance == pytest.approx(1.0 - 0.25 - after, abs=1e-4)
    assert basis.startswith("compute.max_cost_usd $1.0000 less $0.2500 spent before training and $")
    tighter = _spec(tmp_path, 100, train={"max_cost_usd": 0.1}, max_cost_usd=1.0)
    assert training_budget(tighter, plan(tighter, runs), 0.25)[0] == 0.1
    assert training_budget(_spec(tmp_path), forecast, 0.25) == (None, "")


def test_a_training_point_reads_with_the_time_its_steps_left_take():
    point = {"event": "train", "rank": 0, "step": 10, "steps": 40, "loss": 0.5, "samples_per_s": 900.0,
             "eta_s": 150.0}
    assert readable(point) == "train: step 10/40, mean loss 0.5000, 900 samples/s, 2.5 min left"


@pytest.mark.slow  # builds the recipe's model to decide its layout
def test_trnflow_run_refuses_a_run_forecast_past_its_deadline_before_any_job(tmp_path, monkeypatch, dataset):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    data = quickstart_data(registry_url=str(tmp_path / "registry"),
                           data={"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
                                 "inference": str(dataset / "inference")})
    data["train"] = {**data["train"], "checkpoint_url": str(tmp_path / "checkpoints"), "max_minutes": 0.01}
    data["gate"] = {**data.get("gate", {}), "reference": None}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    said = CliRunner().invoke(app, ["run", str(path)])
    assert said.exit_code == 2 and "Traceback" not in said.output, said.output
    assert "refused before its first job" in said.stderr and "train.max_minutes: training is forecast" in said.stderr
    assert "guess: no run of this model yet" in said.stderr and "--override-forecast REASON" in said.stderr
    assert not (tmp_path / "checkpoints").exists()
    blank = CliRunner().invoke(app, ["run", str(path), "--override-forecast", " "])
    assert blank.exit_code == 2 and "--override-forecast needs a reason" in blank.stderr


def test_the_cost_table_and_the_history_show_the_forecast_beside_what_each_stage_took(tmp_path):
    runs = [record_of(_spec(tmp_path, 100), _outcome("a", 100, 400.0, 10.0), at=1)]
    spec = _spec(tmp_path, 100)
    forecast = plan(spec, runs)
    cost = run_cost([job_cost(spec, "train", 20.0), job_cost(spec, "infer", 5.0)])
    assert "forecast" not in cost_markdown(cost)  # a run made without one
    shown = beside(cost, forecast)
    by_stage = {s.stage: s for s in forecast.stages}
    assert [(r.forecast_seconds, r.forecast_usd) for r in shown.rows] == [
        (by_stage[s].seconds, by_stage[s].cost_usd) for s in ("train", "infer")]
    text = cost_markdown(shown)
    assert (f"20.0 s billable: **${cost.rows[0].cost_usd:.4f}** (forecast {by_stage['train'].seconds:.1f} s, "
            f"${by_stage['train'].cost_usd:.4f})\n") in text
    assert f"Total: **${cost.total_usd:.4f}** (forecast ${forecast.cost_usd:.4f})." in text

    outcome = _outcome("b", 100, 400.0, 10.0)
    keep(spec, outcome, tmp_path / "home", forecast)
    kept = next(r for r in history(spec, tmp_path / "home")[0] if r.run_id == "b")
    assert kept.forecast == forecast.stages and kept.forecast_cost_usd == forecast.cost_usd


def test_a_spot_run_is_forecast_at_the_share_of_on_demand_its_earlier_spot_runs_paid(tmp_path):

    spot = _spec(tmp_path, 100, spot=True)
    first = plan(spot, [record_of(_spec(tmp_path, 100), _outcome("a", 100, 400.0, 10.0), at=1)])
    assert first.spot_cost_usd is None and first.expected_cost_usd == first.cost_usd  # on demand: the most
    assert "spot: no spot run of this model measured yet; on-demand is the most it costs" in first.notes
    paid = _outcome("s", 100, 400.0, 10.0)
    row = job_cost(spot, "train", 36.0)
    paid.cost = run_cost([row.model_copy(update={"cost_usd": round(row.cost_usd * 0.3, 4),
                                                 "on_demand_usd": row.cost_usd})])
    record = record_of(spot, paid, at=2)
    assert record.spot and record.on_demand_usd == row.cost_usd
    found = plan(spot, [record])
    share = record.cost_usd / record.on_demand_usd
    assert found.spot_cost_usd == pytest.approx(found.cost_usd * share, abs=1e-4)
    assert f"(spot about ${found.spot_cost_usd:.2f})" in found.headline()
    budget = _spec(tmp_path, 100, spot=True, max_cost_usd=round(found.cost_usd * 0.9, 4))  # on demand: over it
    assert over_limits(budget, plan(budget, [record])) == []  # at spot's share: within it


def test_compile_is_forecast_from_the_runs_that_found_their_programs_in_the_cache(tmp_path):
    def compiled(run_id: str, programs: int, seconds: float) -> RunOutcome:
        outcome = _outcome(run_id, 100, 400.0, 10.0)
        rows = [r if r.stage != "compile" else r.model_copy(update={"seconds": seconds}) for r in outcome.stages]
        result = CompileResult(programs=[], graphs=3, compiler="c", cache="file:///c", compiled=programs,
                               hits=3 - programs)
        return outcome.model_copy(update={"stages": rows, "results": {**outcome.results, "compile": result}})

    spec = _spec(tmp_path, 100)
    cold = record_of(spec, compiled("cold", 3, 60.0), at=1)
    assert cold.stage("compile").work == 3.0
    only_cold = next(s for s in plan(spec, [cold]).stages if s.stage == "compile")
    assert only_cold.seconds == 60.0  # no warm run yet: the one it has
    runs = [cold, record_of(spec, compiled("warm", 0, 2.0), at=2), record_of(spec, compiled("warm2", 0, 3.0), at=3)]
    found = next(s for s in plan(spec, runs).stages if s.stage == "compile")
    assert (found.seconds, found.low, found.high, found.source) == (2.5, 2.0, 3.0, "history")
    assert "whose programs were all in the compile cache" in found.basis

    def checked(misses: int) -> CompileResult:  # the cache's answer (`compile --check`)
        return CompileResult(programs=[], graphs=3, compiler="c", cache="file:///c", check=True, hits=3 - misses,
                             misses=misses)

    warm = next(s for s in plan(spec, runs, cache=checked(0)).stages if s.stage == "compile")
    assert (warm.seconds, warm.source) == (2.5, "checked") and warm.basis.startswith("compile --check: 0 of 3")
    two = next(s for s in plan(spec, runs, cache=checked(2)).stages if s.stage == "compile")
    assert two.seconds == 2.5 + 2 * 20.0 and "at 20 s each as earlier runs compiled theirs" in two.basis
    fresh = next(s for s in plan(spec, [], cache=checked(0)).stages if s.stage == "compile")
    assert (fresh.seconds, fresh.source) == (10.0, "checked") and "a guess" in fresh.basis


def test_a_spot_runs_training_budget_is_given_in_the_on_demand_dollars_its_job_counts(tmp_path):
    spot = _spec(tmp_path, 100, spot=True, max_cost_usd=1.0)
    paid = _outcome("s", 100, 400.0, 10.0)
    row = job_cost(spot, "train", 36.0)
    paid.cost = run_cost([row.model_copy(update={"cost_usd": round(row.cost_usd * 0.25, 4),
                                                 "on_demand_usd": row.cost_usd})])
    forecast = plan(spot, [record_of(spot, paid, at=1)])
    assert forecast.spot_share == pytest.approx(0.25, abs=0.01)  # (the cents are rounded)
    after = sum(s.cost_usd for s in forecast.after("train")) * forecast.spot_share
    allowance, basis = training_budget(spot, forecast, spent_usd=0.1)
    assert allowance == pytest.approx((1.0 - 0.1 - after) / forecast.spot_share, abs=1e-3)
    assert f"at on-demand prices, spot paying {forecast.spot_share:.0%} of them" in basis


def test_a_training_budget_with_no_price_is_refused_not_skipped(tmp_path):
    capped = _spec(tmp_path, 100, train={"max_cost_usd": 5.0})
    unpriced = capped.model_copy(update={"compute": capped.compute.model_copy(
        update={"backend": "sagemaker", "instance_type": "trn2.48xlarge"})})
    assert over_limits(unpriced, plan(unpriced, [])) == [
        "train.max_cost_usd: no price is known for trn2.48xlarge on sagemaker, so the budget cannot be held; set "
        "compute.price_per_hour"]


def test_a_retried_training_attempt_has_only_what_the_attempts_before_it_left(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    spec = _spec(tmp_path, 100, train={"max_cost_usd": 0.01}, price_per_hour=36.0)  # a cent a second
    ledger = JobLedger(tmp_path / "home", "r1")
    ledger.record(LedgerEntry(phase="compile", job_id="c", state="SUCCEEDED", seconds=5.0))
    mark = len(ledger.path.read_bytes())  # the stage begins here: the compile job is not training's
    logger = logging.getLogger("test")
    assert _budget_left(spec, None, "r1", mark, logger) is None  # no budget: none for any attempt
    assert _budget_left(spec, 0.01, "r1", mark, logger) == 0.01  # the first attempt: the whole budget
    ledger.record(LedgerEntry(phase="train", job_id="t1", state="FAILED", seconds=0.4))
    assert _budget_left(spec, 0.01, "r1", mark, logger) == pytest.approx(0.01 - 0.004, abs=1e-4)
    assert spec.train.max_cost_usd == 0.01  # the spec stays as written
    ledger.record(LedgerEntry(phase="train", job_id="t2", state="FAILED", seconds=0.6))
    with pytest.raises(OverBudget, match=r"earlier attempts cost \$0.0100 of its budget of \$0.0100"):
        _budget_left(spec, 0.01, "r1", mark, logger)


def test_a_run_that_waited_and_yielded_keeps_both_in_its_record(tmp_path):
    outcome = _outcome("q", 100, 400.0, 10.0)
    outcome.stages[2:3] = [StageRow(stage="train", state="Preempted", seconds=5.0, summary="yielded"),
                           StageRow(stage="queue", state="Waited", seconds=42.0, summary="this machine is full"),
                           StageRow(stage="train", state="Completed", seconds=30.0)]
    outcome.stages.insert(0, StageRow(stage="queue", state="Waited", seconds=8.0, summary="behind run r1"))
    record = record_of(_spec(tmp_path, 100), outcome, at=1)
    assert (record.queue_wait_s, record.preemptions) == (50.0, 1)
    assert [m.stage for m in record.stages] == ["sanity", "compile", "train", "evaluate", "infer"]  # completed only
    assert record.stage("train").seconds == 30.0


def test_a_teams_daily_spend_limit_refuses_a_run_it_cannot_hold_and_fails_closed(tmp_path):
    from trnflow.teams import UNDECLARED

    spec = _spec(tmp_path, 100)
    forecast = plan(spec, [record_of(spec, _outcome("a", 100, 400.0, 10.0), at=1)])
    assert forecast.cost_usd is not None
    assert over_daily_spend(UNDECLARED, forecast) is None and over_daily_spend(UNDECLARED, None) is None  # no limit
    frugal = UNDECLARED.model_copy(update={"daily_spend_usd": forecast.cost_usd / 2})
    assert over_daily_spend(frugal, forecast).startswith(f"it is forecast to cost ${forecast.cost_usd:.2f}, more than")
    assert "no forecast could be made to hold the run to it" in over_daily_spend(frugal, None)  # fails closed
    ample = UNDECLARED.model_copy(update={"daily_spend_usd": forecast.cost_usd * 2})
    assert over_daily_spend(ample, forecast) is None


def test_goodput_is_the_training_the_weights_hold_over_the_compile_and_train_stages_the_rest_itemized():
    """A run whose training failed once: the attempt that resumed held 40 s of steps from the one
    before (its checkpoint), and took 60 s itself; the train stage took 150 s, 10 s of it
    provisioning; the compile stage 22 s, 2 s of it provisioning."""
    rows = [StageRow(stage="sanity", state="Completed", seconds=3.0),
            StageRow(stage="compile", state="Completed", seconds=22.0),
            StageRow(stage="train", state="Completed", seconds=150.0)]
    before = TrainTime(steps_seconds=40.0, stall_seconds=1.0, eval_seconds=1.5)
    result = TrainResult(checkpoint="x", steps_trained=50, attempt_seconds=60.0, time_before=before,
                         time=TrainTime(steps_seconds=85.0, stall_seconds=2.0, rollback_seconds=3.0, slow_seconds=4.0,
                                        eval_seconds=5.0), final_eval_seconds=2.0)
    costs = [CostRow(stage="compile", instance_type="trn1.2xlarge", nodes=1, price_per_node_hour=1.0,
                     billable_seconds=22.0, cost_usd=0.0, provisioning_seconds=2.0),
             CostRow(stage="train", instance_type="trn1.2xlarge", nodes=1, price_per_node_hour=1.0,
                     billable_seconds=150.0, cost_usd=0.0, provisioning_seconds=10.0, jobs=2)]
    good = goodput(rows, result, costs)  # the final weights' evaluation (2 s, the gate's) is not getting them
    assert good is not None and good.wall_seconds == 170.0 and good.training_seconds == 85.0
    assert good.fraction == round(85 / 170, 4) and good.final_eval_seconds == 2.0
    lost = good.losses
    assert (lost.compilation, lost.provisioning, lost.checkpoint_stalls, lost.rollbacks, lost.slow_ranks,
            lost.evaluations) == (20.0, 12.0, 2.0, 3.0, 4.0, 5.0)
    assert lost.restarts == 150 - 10 - 60 - 42.5  # the failed attempt, less what its checkpoint kept
    assert lost.other == pytest.approx(170 - 85 - 20 - 12 - 2 - 37.5 - 3 - 4 - 5)
    assert str(good).startswith("50.0%: 85.0 s of training in 170.0 s (compilation 20.0 s, provisioning 12.0 s")
    assert str(good).endswith("; the final weights then evaluated in 2.0 s")
    assert goodput(rows[:2], result, costs) is None  # training has not ended
    once = goodput(rows, result, [costs[0], costs[1].model_copy(update={"jobs": 1})])
    assert once is not None and once.losses.restarts == 0.0 and once.losses.other == pytest.approx(lost.other + 37.5)
    assert goodput(rows, TrainResult(checkpoint=None, skipped=True), costs) is None


def test_training_not_forecast_from_this_layouts_runs_loses_what_earlier_runs_lost(tmp_path):
    outcome = _outcome("a", 100, 400.0, 10.0)
    kept = record_of(_spec(tmp_path, 100), outcome, at=1).model_copy(update={"goodput": 0.8})
    assert record_of(_spec(tmp_path, 100), outcome, at=1).goodput is None  # no goodput measured
    same = plan(_spec(tmp_path, 100), [kept])
    assert same.goodput == 0.8 and next(s for s in same.stages if s.stage == "train").source == "history"
    other = _spec(tmp_path, 100, instance_type="trn1.32xlarge", cores_per_node=8)
    train = next(s for s in plan(other, [kept]).stages if s.stage == "train")
    assert train.seconds == pytest.approx((10.0 + 3200 / (400.0 * 4)) / 0.8, abs=0.1)
    assert train.basis.endswith("at 80% goodput") and any("goodput 80.0%" in n for n in plan(other, [kept]).notes)
