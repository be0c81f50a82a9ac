"""The six-stage pipeline end to end on the emulator, under a real Prefect API."""

import json

import pyarrow.parquet as pq
import pytest

from flows.pipeline import STAGES, PipelineFailed, pipeline
from trnflow.errors import GateFailed
from trnflow.gate import metrics_document
from trnflow.reference import run_reference
from trnflow.settings import TrnflowSettings
from trnflow.storage import local_path
from trnflow.workload.checkpoint import MARKER, load_checkpoint


def _run(spec, **kwargs):
    state = pipeline(spec, return_state=True, **kwargs)
    return state, state.result(raise_on_failure=False)


def test_quickstart_pipeline_end_to_end(prefect_api, make_spec, dataset):
    spec = make_spec()
    reference = run_reference(spec)
    assert reference["points"][-1]["step"] == spec.train.steps

    state, outcome = _run(spec)
    assert state.is_completed(), outcome
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
    results = outcome["results"]

    # sanity and collectives ran on every core and checked their answers
    assert results["sanity"]["cores"] == [0, 1] and results["sanity"]["excluded_cores"] == []
    assert {c["engine"] for c in results["sanity"]["per_core"][0]["checks"]} == {
        "tensor", "vector", "scalar", "gpsimd", "memory"}
    assert all(row["correct"] for row in results["collectives"]["rows"])

    # a committed checkpoint with the trained weights
    ckpt = local_path(results["train"]["checkpoint"])
    assert (ckpt / MARKER).is_file()
    assert load_checkpoint(ckpt).step == spec.train.steps

    # a compile cache entry per program, laid out like Neuron's, committed with its done marker
    compiled = results["compile"]
    assert [p["program"] for p in compiled["programs"]] == ["train_step", "eval_step", "embed_step"]
    cache_root = local_path(spec.compile.cache_url)
    for program in compiled["programs"]:
        entry = cache_root / compiled["compiler"] / program["key"]
        assert {"model.fx.txt", "compile_flags.json", "model.neff", "model.done"} <= {p.name for p in entry.iterdir()}
    # and the later stages loaded their graphs from it: nothing was compiled on the spot
    for stage in ("train", "evaluate", "infer"):
        assert results[stage]["compile"]["hits"] == 1 and results[stage]["compile"]["recompiles"] == [], stage

    # the gate compared every point with the fp32 reference (the same maths: identical here)
    verdict = results["evaluate"]["verdict"]
    assert verdict["passed"] and verdict["points"][0]["diff"] == 0.0

    # one embedding row per inference row, in Parquet shards
    table = pq.read_table(local_path(spec.inference.output_url))
    inputs = [json.loads(line)["id"] for line in (dataset / "inference" / "part-00000.jsonl").read_text().splitlines()]
    assert sorted(table.column("id").to_pylist()) == sorted(inputs)
    assert len(table.column("embedding")[0]) == spec.model.d_model
    assert len(list(local_path(spec.inference.output_url).glob("part-*.parquet"))) == -(-len(inputs) // 100)

    # the next run's compile stage hits the cache for every program and compiles nothing
    from prefect import flow

    from tasks.compile import compile_graphs

    @flow
    def compile_again():
        return compile_graphs(spec, "second-run", results["sanity"]["cores"])

    again = compile_again()
    assert again["hits"] == 3 and again["compiled"] == 0
    assert again["programs"] == [{**p, "state": "done", "will": "hit"} for p in compiled["programs"]]
    assert "3 cache hit(s)" in again["summary"]


def test_failed_gate_stops_before_inference_and_is_never_retried(prefect_api, make_spec):
    spec = make_spec(name="gatefail", retries={"max_retries": 2, "backoff_seconds": 0})
    ref_path = local_path(spec.gate.reference)
    ref_path.parent.mkdir(parents=True)
    ref_path.write_text(json.dumps(metrics_document([{"step": spec.train.steps, "accuracy": 0.999}], "gpu")))

    state, outcome = _run(spec)
    assert state.is_failed()
    assert isinstance(outcome, PipelineFailed) and isinstance(outcome.cause, GateFailed)
    assert outcome.stage == "evaluate"
    assert f"step {spec.train.steps}" in str(outcome.cause)
    assert [r["stage"] for r in outcome.stages] == ["sanity", "collectives", "compile", "train", "evaluate"]
    assert not local_path(spec.inference.output_url).exists()
    evaluate_jobs = list(TrnflowSettings().jobs_dir.glob("gatefail-evaluate-*"))
    assert len(evaluate_jobs) == 1  # a failed gate is not retried


def _evaluate_once(spec, checkpoint):
    """The evaluate stage alone, as the pipeline calls it (with the spec's retry policy)."""
    from prefect import flow

    from tasks.evaluate import evaluate_gate
    from tasks.retry_policy import retry_options

    @flow
    def evaluate_only():
        return evaluate_gate.with_options(**retry_options(spec))(spec, "evaluate-only", checkpoint)

    state = evaluate_only(return_state=True)
    return state, state.result(raise_on_failure=False)


@pytest.fixture(scope="module")
def reference_checkpoint(prefect_api, dataset, tmp_path_factory, compile_cache, trnflow_home):
    """One trained fp32 checkpoint (the reference run's), shared by the evaluate-stage tests."""
    from jobspecs import validate_spec
    from tests.conftest import quickstart_data

    root = tmp_path_factory.mktemp("evaluate")
    spec = validate_spec(quickstart_data(
        name="evalonly",
        data={"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
              "inference": str(dataset / "inference")},
        train={"steps": 20, "checkpoint_every": 20, "checkpoint_url": str(root / "ckpt")},
        compile={"cache_url": str(compile_cache)},
        gate={"reference": str(root / "reference" / "metrics.json")},
        inference={"output_url": str(root / "embeddings")},
    ))
    document = run_reference(spec)
    assert json.loads(local_path(spec.gate.reference).read_text()) == document
    return spec, document["checkpoint"]


def test_missing_reference_fails_with_the_fix(reference_checkpoint, tmp_path):
    spec, checkpoint = reference_checkpoint
    spec = spec.model_copy(update={"gate": spec.gate.model_copy(update={"reference": (tmp_path / "x.json").as_uri()})})
    state, error = _evaluate_once(spec, checkpoint)
    assert state.is_failed()
    assert "trnflow reference" in str(error)


def test_no_reference_configured_records_a_baseline(reference_checkpoint):
    spec, checkpoint = reference_checkpoint
    spec = spec.model_copy(update={"gate": spec.gate.model_copy(update={"reference": None})})
    state, result = _evaluate_once(spec, checkpoint)
    assert state.is_completed(), result
    assert "baseline" in result["summary"]
    assert result["points"][0]["step"] == 20


def test_evaluation_matches_the_reference_it_came_from(reference_checkpoint):
    spec, checkpoint = reference_checkpoint
    state, result = _evaluate_once(spec, checkpoint)
    assert state.is_completed(), result
    assert result["verdict"]["passed"] and result["verdict"]["points"][0]["diff"] == 0.0
    series = json.loads((local_path(checkpoint).parent / "metrics.json").read_text())
    assert [p["step"] for p in series["points"]] == [20]
