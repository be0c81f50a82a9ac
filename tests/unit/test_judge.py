"""The gate's decision and registration, called directly: a rerun of the same run registers nothing twice."""

import pytest

from tests.factories import checkpoint_meta, commit
from trnflow.errors import ChampionKept, GateFailed
from trnflow.lifecycle.digests import verified_manifest
from trnflow.lifecycle.judge import (
    Candidate,
    Check,
    Decision,
    Registration,
    decide,
    outcome,
    register,
    settle,
    up_to,
)
from trnflow.lifecycle.registry import Registry
from trnflow.records import MetricSeries, Verdict, dump

VERDICT = Verdict(metric="accuracy", mode="every-point", max_abs_diff=0.001, passed=True)
PASSED = Decision([Check(VERDICT, None, "no reference set")], VERDICT, "no reference set")


def _meta(run: str, files=("dt=2026-01-01/part-0.parquet",)) -> bytes:
    return dump(checkpoint_meta(run, files=tuple(files)))


def _checkpoint(root, run: str, files=("dt=2026-01-01/part-0.parquet",)):
    ckpt = root / "ckpt" / run / "step-000040"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_bytes(_meta(run, files))
    commit(ckpt)
    return Candidate(ckpt.as_uri(), MetricSeries.model_validate({"points": [{"step": 40, "accuracy": 0.8}]}))


def test_a_rerun_of_the_same_spec_on_the_same_data_registers_no_second_version(make_spec, tmp_path):
    """Item 3: another run id, the same spec and data files: the version it would make is there."""
    spec = make_spec()
    registry = Registry(spec.registry_url)
    first = register(spec, registry, _checkpoint(tmp_path, "run-a"), "run-a", PASSED, 0)
    again = register(spec, registry, _checkpoint(tmp_path, "run-b"), "run-b", PASSED, registry.generation(spec.name))
    assert again.version == first.version == 1 and again.registered_before and not again.promoted
    assert again.checkpoint == first.checkpoint  # later stages use the registered model, not the rerun's
    recorded = registry.version(spec.name, 1).entry.digests  # what the gate passed, pinned
    assert recorded is not None and recorded.checkpoint == verified_manifest(first.checkpoint, "COMMITTED")
    newer = register(spec, registry, _checkpoint(tmp_path, "run-c", files=("dt=2026-01-01/part-0.parquet",
                                                                           "dt=2026-01-02/part-0.parquet")),
                     "run-c", PASSED, registry.generation(spec.name))
    assert newer.version == 2 and [v.version for v in registry.versions(spec.name)] == [1, 2]


def _series(accuracy: float, correct: str) -> MetricSeries:
    return MetricSeries.model_validate({"points": [{"step": 40, "accuracy": accuracy}], "holdout_sha256": "h",
                                        "predictions": {"step": 40, "correct": correct}})


def test_a_candidate_worse_than_the_champion_passes_the_gate_but_is_not_promoted(make_spec, tmp_path):
    """Item 1: no reference file, a champion 0.3 points better on the same holdout: the decision
    passes the parity gate and names the champion's check as the one that failed."""
    spec = make_spec(gate={"reference": None})
    registry = Registry(spec.registry_url)
    decision = decide(spec, registry, _series(0.80, "1" * 800 + "0" * 200), False,
                      (_series(0.803, "1" * 803 + "0" * 197), "champion v1"))
    assert decision.gate_passed and not decision.passed
    worse = decision.worse_than_champion
    assert worse is not None and worse.against == "champion v1" and "below champion v1" in worse.verdict.reason
    kept, notes = settle(decision, None, "weak", forced=None)  # the stage passes; the run ends ChampionKept
    assert kept is not None and kept.headline.startswith("the candidate registered, not promoted: accuracy -0.0030")
    assert "--run-id weak --force-promote" in kept.message and isinstance(kept.error(), ChampionKept)
    assert notes == [] and outcome(decision) == "gate passed; champion v1 kept"  # the parity chart's title
    assert outcome(decision, forced="a label bug") == "gate passed; promoted over champion v1, as asked"
    assert settle(decision, None, "weak", forced="a label bug")[0] is None
    better = decide(spec, registry, _series(0.81, "1" * 810 + "0" * 190), False,
                    (_series(0.803, "1" * 803 + "0" * 197), "champion v1"))
    assert better.passed and better.worse_than_champion is None and outcome(better) == "gate passed"
    outside = VERDICT.model_copy(update={"passed": False, "reason": "step 40: accuracy 0.5 vs 0.8"})
    failed = Decision([Check(outside, None, "metrics.json")], outside, "metrics.json")
    assert outcome(failed) == "gate FAILED"
    with pytest.raises(GateFailed, match=r"gate failed against metrics\.json: step 40"):
        settle(failed, None, "weak", forced="a label bug")  # never promotable, whatever the reason


def test_a_gate_on_loss_keeps_out_a_candidate_of_higher_loss_than_the_champion(make_spec):
    """gate.metric loss: lower is better, as the candidate's series says; the band is relative."""
    spec = make_spec(gate={"reference": None, "metric": "loss"})
    relative = {**spec.gate.model_dump(exclude={"max_abs_diff"}), "max_rel_diff": 0.05}
    spec = spec.model_copy(update={"gate": type(spec.gate).model_validate(relative)})

    def series(loss: float) -> MetricSeries:
        points = [{"step": 40, "accuracy": 0.8, "loss": loss}]
        return MetricSeries.model_validate({"points": points, "holdout_sha256": "h",
                                            "directions": {"accuracy": "higher", "loss": "lower"}})

    registry = Registry(spec.registry_url)
    higher = decide(spec, registry, series(0.43), False, (series(0.40), "champion v1"))
    assert higher.gate_passed and not higher.passed  # 5% of 0.40 is 0.02: 0.43 is outside
    assert "0.0300 above champion v1's" in higher.worse_than_champion.verdict.reason
    lower = decide(spec, registry, series(0.30), False, (series(0.40), "champion v1"))
    assert lower.passed and lower.verdict.better == "lower" and lower.verdict.max_rel_diff == 0.05


@pytest.mark.parametrize("forced, status, promoted", [(None, "worse-than-champion", False),
                                                      ("hot fix for a label bug", "passed", True)])
def test_a_worse_candidate_is_registered_and_promoted_only_when_forced(make_spec, tmp_path, forced, status, promoted):
    spec = make_spec(gate={"reference": None})
    registry = Registry(spec.registry_url)
    register(spec, registry, _checkpoint(tmp_path, "champ"), "champ", PASSED, 0)
    decision = decide(spec, registry, _series(0.70, "1" * 7 + "0" * 3), False, (_series(0.8, "1" * 8 + "00"), "v1"))
    got = register(spec, registry, _checkpoint(tmp_path, "cand", files=("dt=2026-01-03/part-0.parquet",)), "cand",
                   decision, registry.generation(spec.name), forced=forced)
    entry = registry.version(spec.name, got.version).entry
    assert got.promoted is promoted and entry.status == status
    assert registry.champion(spec.name).version == (2 if promoted else 1)
    if forced:
        assert entry.forced == forced
        assert registry.history(spec.name)[-1].reason == "forced: hot fix for a label bug (cand)"


def test_a_rerun_of_the_same_run_reuses_its_version_and_does_not_promote_again(make_spec, tmp_path):
    spec = make_spec()
    ckpt = tmp_path / "ckpt" / "run" / "step-000040"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_bytes(_meta("run"))
    commit(ckpt)
    registry = Registry(spec.registry_url)
    candidate = Candidate(ckpt.as_uri(), MetricSeries.model_validate({"points": [{"step": 40, "accuracy": 0.8}]}))
    first = register(spec, registry, candidate, "run", PASSED, registry.generation(spec.name))
    again = register(spec, registry, candidate, "run", PASSED, registry.generation(spec.name))
    assert first == Registration(version=1, promoted=True, generation=0, checkpoint=ckpt.as_uri())
    assert again == Registration(version=1, promoted=False, generation=1, checkpoint=ckpt.as_uri(),
                                 registered_before=True)
    assert again.model_dump() == {"version": 1, "promoted": False, "generation": 1, "checkpoint": ckpt.as_uri(),
                                  "registered_before": True, "forced": False}
    assert len(registry.versions(spec.name)) == 1 and len(registry.history(spec.name)) == 1


def test_an_older_checkpoint_is_gated_on_its_own_points():
    series = MetricSeries.model_validate({"points": [{"step": 20, "accuracy": 0.7}, {"step": 40, "accuracy": 0.8}],
                                          "predictions": {"step": 40, "correct": "01"}})
    at_20 = up_to(series, 20)
    assert at_20.steps() == [20] and at_20.predictions is None
    assert up_to(series, 40) == series


def test_a_champion_that_cannot_be_compared_keeps_its_place_and_a_series_without_a_holdout_is_not_the_same(
        make_spec):
    """A champion of another model measured on another holdout cannot be compared row for row:
    the candidate may pass the gate, but only a forced promotion replaces the champion. A series
    that does not say which holdout it was measured on is never taken for the candidate's."""
    from trnflow.lifecycle.judge import incomparable, same_holdout

    spec = make_spec(gate={"reference": None})
    check = incomparable(spec, None, "champion v1", "champion v1 is another model")
    decision = decide(spec, Registry(spec.registry_url), _series(0.9, "1" * 9 + "0"), False, check)
    assert decision.gate_passed and decision.worse_than_champion is check
    assert not same_holdout(MetricSeries(holdout_sha256="h"), MetricSeries())
    assert same_holdout(MetricSeries(holdout_sha256="h"), MetricSeries(holdout_sha256="h"))
