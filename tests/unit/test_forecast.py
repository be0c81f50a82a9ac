"""The forecast of a run's time and cost from the runs before it (`trnflow.reporting.forecast`)."""

from __future__ import annotations

import pytest

from tests.conftest import quickstart_data
from trnflow.reporting.cost import price_per_hour
from trnflow.reporting.forecast import Layout, history, keep, plan, record_of
from trnflow.results import InferResult, RunOutcome, StageRow, TrainResult
from trnflow.specs import validate_spec


def _spec(tmp_path, steps: int = 100, **compute):
    return validate_spec(quickstart_data(train={"steps": steps, "global_batch_size": 32,
                                                "parallelism": {"strategy": "ddp"}},
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
    assert (train.work, train.rate) == (3200.0, 400.0) and records[0].layout == Layout.of(spec)
    (tmp_path / "registry" / "quickstart" / "history" / "torn.json").write_text("{")
    records, unread = history(spec, tmp_path / "home")
    assert [r.run_id for r in records] == ["r1"] and unread == ["torn.json: ValidationError"]


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
    import json

    import yaml
    from typer.testing import CliRunner

    from trnflow.cli.app import app

    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(registry_url=str(tmp_path / "registry"))))
    said = CliRunner().invoke(app, ["plan", str(path), "--json"])
    assert said.exit_code == 0, said.output
    forecast = json.loads(said.stdout)
    assert {s["source"] for s in forecast["stages"]} == {"guess"} and forecast["layout"]["strategy"] != "auto"
    bad = CliRunner().invoke(app, ["plan", str(path), "--set", "train.steps=0"])
    assert bad.exit_code == 2 and "train.steps" in bad.stderr and "Traceback" not in bad.output
