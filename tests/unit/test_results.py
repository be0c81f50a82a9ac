"""The typed results: a phase's result.json becomes its model, an unknown or missing field is an error
at that boundary, and a run's outcome keeps each stage's own fields when it is written as JSON."""

import json

import pytest
from pydantic import ValidationError

from trnflow.results import (
    RESULTS,
    CompileMetrics,
    Cost,
    CostRow,
    InferResult,
    RunOutcome,
    StageRow,
    TrainResult,
    parse,
)


def _infer() -> dict:
    return {"phase": "infer", "output_url": "file:///e", "model_version": "v1", "rows": 3,
            "shards": [{"shard": 0, "file": "part-00000.parquet", "rows": 3, "sha256": "ab", "reused": False}],
            "rows_embedded": 3, "shards_reused": 0, "manifest": "file:///e/_manifest.json", "rows_per_s": 10.0,
            "program_load_seconds": 0.1, "compile": {"graphs": 0, "hits": 1, "recompiles": [], "seconds": 0.0}}


def test_a_phase_result_is_parsed_into_its_own_model():
    result = parse("infer", {**_infer(), "cores": [0, 1]})
    assert isinstance(result, InferResult) and result.cores == [0, 1]
    assert result.compile == CompileMetrics(hits=1)
    assert set(RESULTS) == {"sanity", "collectives", "compile", "train", "evaluate", "infer", "promote"}


def test_a_field_the_model_does_not_know_or_lacks_is_refused_and_named():
    with pytest.raises(ValidationError, match="rows_per_second"):
        parse("infer", {**_infer(), "rows_per_second": 1.0})
    broken = _infer()
    del broken["rows"]
    with pytest.raises(ValidationError, match="rows"):
        parse("infer", broken)
    with pytest.raises(ValidationError, match="steps_trained"):
        TrainResult(checkpoint=None, steps_trained="many")


def test_a_run_outcome_keeps_each_stages_fields_in_json():
    outcome = RunOutcome(run_id="r1", stages=[StageRow(stage="infer", state="Completed", seconds=1.5, summary="ok",
                                                            device="emulator")],
                         results={"infer": parse("infer", _infer())},
                         cost=Cost(rows=[CostRow(stage="infer", instance_type="trn1.2xlarge", nodes=1,
                                                 price_per_node_hour=1.0, billable_seconds=3.6, cost_usd=0.001)],
                                   total_usd=0.001))
    document = json.loads(outcome.model_dump_json())
    assert document["results"]["infer"]["manifest"] == "file:///e/_manifest.json"  # a subclass field, kept
    assert document["stages"] == [{"stage": "infer", "state": "Completed", "seconds": 1.5, "summary": "ok",
                                   "device": "emulator"}]
    assert document["cost"]["total_usd"] == 0.001


def test_a_summary_assigned_later_is_validated_too():
    result = parse("infer", _infer())
    result.summary = "3 embeddings"
    assert result.summary == "3 embeddings"
    with pytest.raises(ValidationError):
        result.rows = "three"
