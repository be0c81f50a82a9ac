"""`trnflow plan` on the real history: two quickstart runs keep what they measured beside the
registry, and the forecast of a third rests on exactly those measurements."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from trnflow.cli.app import app
from trnflow.reporting.forecast import history

runner = CliRunner()


@pytest.mark.slow
def test_the_forecast_of_a_run_rests_on_what_the_runs_before_it_measured(prefect_api, make_spec, tmp_path,
                                                                         trnflow_home):
    from trnflow.backends.reference import run_reference
    from trnflow.flows.pipeline import pipeline

    steps = {"first": 10, "second": 20}
    outcomes = {}
    for run_id, count in steps.items():
        spec = make_spec(1, train={"steps": count, "checkpoint_every": 10, "log_every": 5}, gate={"eval_every": 10})
        run_reference(spec)
        outcomes[run_id] = pipeline(spec, run_id=run_id, force_promote="the test measures it, whatever its accuracy")
    records, unread = history(spec, trnflow_home)
    assert unread == [] and [r.run_id for r in records] == ["first", "second"]
    for record in records:  # the measurements are the run's own
        outcome, train = outcomes[record.run_id], record.stage("train")
        assert train.rate == outcome.results["train"].samples_per_s
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
    text = runner.invoke(app, ["plan", str(path)])
    assert text.exit_code == 0 and "forecast: " in text.stdout and "from history" in text.stdout, text.output
    checked = runner.invoke(app, ["validate", str(path), "--json"])  # validate's one line
    notes = json.loads(checked.stdout)[0]["notes"]
    assert checked.exit_code == 0 and any(n.startswith("forecast: ") and "from history" in n for n in notes), notes
