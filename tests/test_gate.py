import json

import pytest

from trnflow.errors import DataError
from trnflow.gate import compare, metrics_document, parse_metrics

REF = [{"step": 100, "accuracy": 0.80}, {"step": 200, "accuracy": 0.85}]


def test_within_band_passes_with_every_point_listed():
    cand = [{"step": 100, "accuracy": 0.8005}, {"step": 200, "accuracy": 0.8491}]
    verdict = compare(cand, REF, "accuracy", 0.001)
    assert verdict["passed"]
    assert [(p["step"], p["passed"]) for p in verdict["points"]] == [(100, True), (200, True)]
    assert verdict["points"][0]["diff"] == pytest.approx(0.0005)


def test_outside_band_fails_and_names_the_failing_point():
    cand = [{"step": 100, "accuracy": 0.8005}, {"step": 200, "accuracy": 0.847}]
    verdict = compare(cand, REF, "accuracy", 0.001)
    assert not verdict["passed"]
    assert [p["step"] for p in verdict["points"] if not p["passed"]] == [200]
    assert "step 200" in verdict["reason"] and "step 100" not in verdict["reason"]


def test_no_common_step_fails_with_explanation():
    verdict = compare([{"step": 150, "accuracy": 0.8}], REF, "accuracy", 0.001)
    assert not verdict["passed"]
    assert "no common evaluation step" in verdict["reason"]


def test_metrics_document_round_trips():
    doc = metrics_document([{"step": 200, "accuracy": 0.85}, {"step": 100, "accuracy": 0.8}], "gpu")
    assert [p["step"] for p in doc["points"]] == [100, 200]
    assert parse_metrics(json.dumps(doc), "ref.json", "accuracy") == doc["points"]


@pytest.mark.parametrize("text", ["not json", "[]", '{"points": []}', '{"points": [{"step": "1", "accuracy": 1}]}'])
def test_bad_metrics_files_are_refused_clearly(text):
    with pytest.raises(DataError, match=r"ref\.json"):
        parse_metrics(text, "ref.json", "accuracy")
