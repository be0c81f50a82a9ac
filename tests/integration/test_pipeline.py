"""The six-stage pipeline end to end on the emulator, under a real Prefect API."""

import json
import re
import shutil

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from trnflow.backends.reference import run_reference
from trnflow.cli.app import app
from trnflow.errors import FatalError, GateFailed
from trnflow.flows.batch_inference import batch_inference
from trnflow.flows.pipeline import STAGES, PipelineFailed, pipeline
from trnflow.lifecycle.gate import series_of
from trnflow.lifecycle.registry import Registry
from trnflow.records import MetricPoint
from trnflow.results import (
    CollectivesResult,
    CompileResult,
    EvaluateResult,
    InferResult,
    PromoteResult,
    SanityResult,
    TrainResult,
)
from trnflow.storage import local_path
from trnflow.workload.checkpoint import MARKER, load
from trnflow.workload.embeddings import current, current_url, manifest


def _run(spec, **kwargs):
    state = pipeline(spec, return_state=True, **kwargs)
    return state, state.result(raise_on_failure=False)


def _artifacts(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {a.key: a for a in found}


def _logs(flow_run_id) -> list[str]:
    """Every log line of a flow run and its tasks, as the run page shows them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)  # the handler sends in batches, from a thread of its own
    with get_client(sync_client=True) as client:
        return [log.message for log in client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), sort=LogSort.TIMESTAMP_ASC)]


def test_a_run_stopped_before_its_first_job_says_why_in_its_state_summary_and_stages(prefect_api, make_spec,
                                                                                     trnflow_home):
    """As a run started from the UI with a reference nobody wrote: the reason is the final state's
    message (the runs list and the run page's header show it), the summary's first line and each
    stage's row; the log says it once, with no traceback; no job started."""
    spec = make_spec(cores=1, name="noref")
    state, outcome = _run(spec, run_id="noref-run")
    assert state.is_failed() and state.name == "Failed" and isinstance(outcome, FatalError)
    reason = f"before training: gate.reference: {spec.gate.reference} does not exist; create it with `trnflow reference"
    assert state.message.startswith(reason), state.message
    artifacts = _artifacts(state.state_details.flow_run_id)
    summary = artifacts["noref-summary"].data
    assert summary.splitlines()[0] == f"## noref run noref-run: {state.message}"
    assert all(f"- **{stage}**, *NotRun*: not run: {reason}" in summary for stage in STAGES), summary
    rows = json.loads(artifacts["noref-stages"].data)
    assert [(r["stage"], r["state"]) for r in rows] == [(stage, "NotRun") for stage in STAGES]
    assert all(r["key figure"].startswith(f"not run: {reason}") for r in rows)
    logs = _logs(state.state_details.flow_run_id)
    assert any(line.startswith(reason) for line in logs) and not any("Traceback" in line for line in logs), logs
    assert not list((trnflow_home / "jobs").glob("noref-*"))


def test_a_run_whose_spec_is_refused_is_named_for_its_spec_and_says_which_field(prefect_api, make_spec):
    """As a run from the UI's form with a value the spec's own checks refuse: it fails at once, named
    `<spec name>: pipeline` (not a random name), its message the field and the fix, no traceback."""
    from prefect.client.orchestration import get_client

    given = make_spec(cores=1, name="refused").model_dump(mode="json")
    given["schedule"] = {"cron": "0 25 * * *"}
    state = pipeline(given, return_state=True)
    assert state.is_failed() and state.message.startswith("schedule.cron: '0 25 * * *': the hour field '25' has 25, "
                                                          "outside 0-23"), state.message
    assert "(spec" not in state.message
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).name == "refused: pipeline"
    assert not any("Traceback" in line for line in _logs(state.state_details.flow_run_id))


@pytest.mark.slow
def test_quickstart_pipeline_end_to_end_on_the_healthy_cores(prefect_api, make_spec, dataset):
    """The whole pipeline on a trn1.32xlarge whose core 1 computes wrong answers: preflight finds it,
    excludes it, and every later stage runs on the cores it verified."""
    spec = make_spec(gate={"eval_every": 20}, compute={"instance_type": "trn1.32xlarge"},
                     faults=[{"kind": "corrupt", "core": 1}], preflight={"exclude_bad_cores": True})
    reference = run_reference(spec)
    assert reference.steps() == [20, 40]

    state, outcome = _run(spec)
    assert state.is_completed(), outcome
    assert [(r.stage, r.state) for r in outcome.stages] == [(s, "Completed") for s in STAGES]
    assert [type(outcome.results[s]) for s in STAGES] == [SanityResult, CollectivesResult, CompileResult, TrainResult,
                                                          EvaluateResult, InferResult, PromoteResult]
    results = outcome.model_dump(mode="json")["results"]

    # sanity checked every engine, named the bad core and moved on; collectives checked their answers
    sanity = results["sanity"]
    assert sanity["excluded_cores"] == [1] and sanity["cores"] == [2, 3]
    assert "excluded bad core(s) [1]" in sanity["summary"]
    assert {c["engine"] for c in sanity["per_core"][0]["checks"]} == {"tensor", "vector", "scalar", "gpsimd", "memory"}
    assert all(row["correct"] for row in results["collectives"]["rows"])
    for stage in ("collectives", "train", "infer"):  # evaluation runs inside the training job
        assert results[stage]["cores"] == [2, 3], stage
    # the sanity job that passed swept the links between its cores too: preflight took no job more
    assert results["collectives"]["phase"] == "sanity" and results["sanity"]["collectives"] == results["collectives"]

    # a committed checkpoint with the trained weights
    ckpt = local_path(results["train"]["checkpoint"])
    assert (ckpt / MARKER).is_file()
    assert load(results["train"]["checkpoint"]).step == spec.train.steps

    # a compile cache entry per program, laid out like Neuron's, committed with its done marker
    compiled = results["compile"]
    assert [p["program"] for p in compiled["programs"]] == ["train_step", "eval_step", "embed_step"]
    cache_root = local_path(spec.compile.cache_url)
    for program in compiled["programs"]:
        entry = cache_root / compiled["compiler"] / program["key"]
        assert {"model.fx.txt", "compile_flags.json", "model.neff", "model.done"} <= {p.name for p in entry.iterdir()}
    # and the later stages loaded their graphs from it: nothing was compiled on the spot
    assert results["train"]["compile"]["hits"] == 2  # the training step, and evaluation as it trains
    assert results["infer"]["compile"]["hits"] == 1
    assert results["train"]["compile"]["recompiles"] == results["infer"]["compile"]["recompiles"] == []

    # the gate compared every evaluation point with the fp32 reference (the same maths: identical)
    verdict = results["evaluate"]["verdict"]
    assert verdict["passed"] and [(p["step"], p["diff"]) for p in verdict["points"]] == [(20, 0.0), (40, 0.0)]
    paired = verdict["paired"]
    assert paired["available"] and paired["candidate_only"] == paired["reference_only"] == 0
    assert paired["rows"] == 400 and paired["underpowered"]  # 400 rows cannot resolve 0.1%
    assert {"loss", "f1", "auc"} <= set(results["evaluate"]["points"][-1])

    # the parity chart beside the checkpoint, and the verdict and chart on the flow run
    assert local_path(results["evaluate"]["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    artifacts = _artifacts(state.state_details.flow_run_id)
    # a chart is Markdown with the image inline (an image artifact's page prints the data URL)
    assert artifacts["quickstart-parity"].type == "markdown"
    assert "![parity](data:image/png;base64,iVBOR" in artifacts["quickstart-parity"].data
    assert "| 40 | 40 |" in artifacts["quickstart-gate"].data
    # and every stage's table or chart, with the run's summary, cost and outputs
    assert "| nc1 | **FAIL**" in artifacts["quickstart-sanity"].data
    assert "| all_reduce | 65,536 |" in artifacts["quickstart-collectives"].data
    assert f"{compiled['hits']} hit(s), {compiled['compiled']} compiled" in artifacts["quickstart-compile"].data
    assert "![training](data:image/png;base64,iVBOR" in artifacts["quickstart-training"].data
    embeddings = artifacts["quickstart-embeddings"]  # a local file: its path, not a link that opens nothing
    assert embeddings.type == "markdown" and "_manifest.json`" in embeddings.data and "file://" not in embeddings.data
    summary = artifacts["quickstart-summary"].data
    assert all(f"- **{stage}**, Completed in " in summary for stage in STAGES)
    assert "## What the jobs cost" in summary and f"`{local_path(results['train']['checkpoint'])}`" in summary
    assert "file://" not in summary.split("## Outputs")[1]

    # each job's billable time at trn1.32xlarge's price, and the run's total
    cost = outcome.cost.model_dump()
    assert {"sanity", "train", "infer"} <= {r["stage"] for r in cost["rows"]}
    assert all(r["price_per_node_hour"] == 21.50 and r["billable_seconds"] > 0 for r in cost["rows"])
    # the placement with the bad core cost a sanity job of its own; nothing else ran twice, the
    # collectives came with the sanity job that passed (and a compile stage whose cache an earlier
    # test filled launches no job at all)
    launched = {"compile": 1} if results["compile"]["launched"] else {}
    assert {r["stage"]: r["jobs"] for r in cost["rows"]} == {"sanity": 2, **launched, "train": 1, "infer": 1}
    assert cost["total_usd"] == pytest.approx(sum(r["cost_usd"] for r in cost["rows"]), abs=1e-3)
    # goodput: the steps the weights hold over the compile and train stages, the rest itemized; the
    # final weights' evaluation (the gate's) apart
    good = outcome.cost.goodput
    seconds = {r.stage: r.seconds for r in outcome.stages}
    assert good is not None and good.final_eval_seconds == results["train"]["final_eval_seconds"] > 0
    assert good.wall_seconds == pytest.approx(seconds["compile"] + seconds["train"] - good.final_eval_seconds,
                                              abs=1e-3)
    assert 0 < good.training_seconds < good.wall_seconds and good.fraction == round(good.training_seconds /
                                                                                    good.wall_seconds, 4)
    assert sum(v for _, v in good.losses) + good.training_seconds == pytest.approx(good.wall_seconds, abs=0.01)
    assert good.losses.checkpoint_stalls > 0 and good.losses.rollbacks == 0.0
    assert good.losses.restarts == 0.0  # one attempt
    assert f"Goodput: {good} (the training" in summary

    # the candidate is registered, and, having passed and its outputs written, promoted
    assert results["evaluate"]["registry"] == {"version": 1, "promoted": False, "generation": 0, "forced": False,
                                               "checkpoint": results["train"]["checkpoint"], "registered_before": False}
    assert results["promote"]["version"] == 1 and results["promote"]["generation"] == 1
    champion = Registry(spec.registry_url).champion(spec.name)
    assert champion.checkpoint == results["train"]["checkpoint"] and champion.watermark == "2026-01-02"

    # one embedding row per inference row, in Parquet shards of the version's own folder, published
    out = local_path(current_url(spec.inference.output_url))
    assert out == local_path(spec.inference.output_url) / "v000001"
    table = pq.read_table(out)
    inputs = [json.loads(line)["id"] for line in (dataset / "inference" / "part-00000.jsonl").read_text().splitlines()]
    assert sorted(table.column("id").to_pylist()) == sorted(inputs)
    assert len(table.column("embedding")[0]) == spec.model.params["d_model"]
    shards = -(-len(inputs) // 100)
    assert len(list(out.glob("part-*.parquet"))) == shards
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [s["rows"] for s in manifest["shards"]] == [100, 100, 100, 50] and manifest["rows"] == len(inputs)

    # the next run's compile stage hits the cache for every program and compiles nothing
    from prefect import flow

    from trnflow.tasks.compile import compile_graphs
    from trnflow.workload.memory import decided

    @flow
    def compile_again():  # the task, given the spec as a run's flow gives it: its layout decided
        return compile_graphs(decided(spec), "second-run", results["sanity"]["cores"])

    again = compile_again()
    assert again.hits == 3 and again.compiled == 0
    assert [p.model_dump() for p in again.programs] == [{**p, "state": "done", "will": "hit"}
                                                        for p in compiled["programs"]]
    assert "3 cache hit(s)" in again.summary


def test_failed_gate_stops_before_inference_is_never_retried_and_keeps_the_champion(prefect_api, make_spec):
    spec = make_spec(cores=1, name="gatefail", retries={"max_retries": 2, "backoff_seconds": 0})
    ref_path = local_path(spec.gate.reference)
    ref_path.parent.mkdir(parents=True)
    ref_path.write_text(series_of([MetricPoint(step=spec.train.steps, global_step=spec.train.steps,
                                               values={"accuracy": 0.999})], "gpu").model_dump_json())
    registry = Registry(spec.registry_url)
    registry.promote("gatefail", registry.register("gatefail", {"checkpoint": "file:///earlier/step-000010"}).version)

    state, outcome = _run(spec)
    assert state.is_failed() and state.name == "GateFailed"  # its own state: `trnflow submit --wait` exits 3
    # the reason in one short line, as the run page's state message (the whole of it in the log and artifacts)
    assert re.fullmatch(rf"accuracy -0\.\d{{4}} vs .+ at step {spec.train.steps} \(allowed ±{spec.gate.max_abs_diff}\)"
                        r"(; \d+ more steps? outside it)?", state.message), state.message
    assert isinstance(outcome, PipelineFailed) and isinstance(outcome.cause, GateFailed)
    assert outcome.stage == "evaluate"
    assert f"step {spec.train.steps}" in str(outcome.cause)
    assert [r.stage for r in outcome.stages] == ["sanity", "collectives", "compile", "train", "evaluate"]
    assert not list(local_path(spec.inference.output_url).rglob("*"))  # checked writable before training; no shard
    assert _task_run_counts(state.state_details.flow_run_id)["evaluate"] == 1  # a failed gate is not retried
    assert registry.champion("gatefail").version == 1
    assert registry.version("gatefail", 2).entry.status == "rejected"
    summary = _artifacts(state.state_details.flow_run_id)["gatefail-summary"].data
    assert summary.splitlines()[0].endswith(f": GateFailed: {state.message}")
    assert "- **infer**, *NotRun*: not run: evaluate failed\n" in summary


def test_a_candidate_worse_than_the_champion_is_kept_out_unless_forced_with_a_reason(prefect_api, make_spec):
    """Item 1: a plain run whose model is worse than the champion on the same holdout is registered
    but not promoted, ends in `ChampionKept` (exit 5) before inference, and says why; the same run
    again with `force_promote` promotes it and the registry records the reason. Each is also judged
    against the fp32 reference of its spec and data (`gate.reference: auto`): trained by the run that
    first needs it, found on record by the next."""
    from trnflow.errors import ChampionKept
    from trnflow.lifecycle.references import reference_url

    spec = make_spec(cores=1, name="protect", gate={"reference": "auto"}, train={"steps": 80, "checkpoint_every": 40})
    state, outcome = _run(spec, run_id="strong")
    assert state.is_completed(), outcome
    registry = Registry(spec.registry_url)
    assert registry.champion("protect").version == 1
    reference = outcome.results["reference"]
    assert reference.trained and reference.summary.startswith("trained in fp32: 80 steps, accuracy ")
    assert [r.stage for r in outcome.stages] == ["sanity", "collectives", "compile", "train", "reference", "evaluate",
                                                 "infer", "promote"]
    kept = json.loads(local_path(reference_url(spec)).read_text())
    assert kept["source"] == "fp32-reference" and kept["checkpoint"].startswith(spec.train.checkpoint_url)
    assert outcome.results["evaluate"].against == "fp32-reference"  # judged against it (no champion yet)

    weak = spec.model_copy(update={"train": spec.train.model_copy(update={"steps": 4, "checkpoint_every": 4})})
    state, outcome = _run(weak, run_id="weak")
    assert state.is_failed() and state.name == "ChampionKept"
    assert state.message.startswith("v2 registered, not promoted: accuracy -0.") and " vs champion v1 " in state.message
    assert isinstance(outcome.cause, ChampionKept) and outcome.stage == "evaluate"
    assert "v2 passed the gate but was not promoted" in str(outcome.cause)
    assert "below champion v1" in str(outcome.cause) and "--force-promote" in str(outcome.cause)
    assert [(r.stage, r.state) for r in outcome.stages][-2:] == [("reference", "Completed"), ("evaluate", "Completed")]
    assert registry.champion("protect").version == 1  # the stage passed; the run ended on what it decided
    assert registry.version("protect", 2).entry.status == "worse-than-champion"

    state, outcome = _run(weak, run_id="weak", force_promote="the old champion leaked labels")
    assert state.is_completed(), outcome
    found = next(r for r in outcome.stages if r.stage == "reference")  # the 4-step one, trained by the run before
    assert found.state == "Skipped" and found.summary.startswith("on record, trained by an earlier run")
    assert registry.champion("protect").version == 2
    assert registry.history("protect")[-1].reason == "forced: the old champion leaked labels (weak)"
    assert len(registry.versions("protect")) == 2

    # item 2: each version's outputs are its own; a rollback republishes the old ones
    out = local_path(spec.inference.output_url)
    assert current(str(out))["version"] == 2
    v1 = (out / "v000001" / "_manifest.json").read_text()
    models = ["models", "rollback", "protect", "-r", spec.registry_url, "--json"]
    rolled = CliRunner().invoke(app, models)
    assert rolled.exit_code == 0, rolled.output
    assert json.loads(rolled.stdout)["published"].startswith("350 rows published as current")
    assert registry.champion("protect").version == 1 and current(str(out))["version"] == 1
    assert (out / "v000001" / "_manifest.json").read_text() == v1 and (out / "v000002" / "_manifest.json").is_file()

    # a version whose outputs are gone cannot become champion until `trnflow infer --model` writes them
    shutil.rmtree(out / "v000002")
    refused = CliRunner().invoke(app, ["models", "promote", "protect", "2", "-r", spec.registry_url])
    assert refused.exit_code == 1 and "trnflow infer SPEC --model 2" in " ".join(refused.stderr.split())
    assert registry.champion("protect").version == 1
    state = batch_inference(spec, model="2", return_state=True)
    assert state.is_completed() and manifest(str(out / "v000002"))["rows"] == 350
    assert current(str(out))["version"] == 1  # v2 is not the champion: nothing republished
    promoted = CliRunner().invoke(app, ["models", "promote", "protect", "2", "-r", spec.registry_url])
    assert promoted.exit_code == 0, promoted.output
    assert current(str(out))["version"] == 2

    # inference with the champion on demand never rewrites its published folder in place
    published = (out / "v000002" / "_manifest.json").read_text()
    state = batch_inference(spec, model="champion", run_id="on-demand", return_state=True)
    assert state.is_completed()
    assert current(str(out))["folder"] == "v000002-on-demand" and manifest(str(out / "v000002-on-demand"))
    assert (out / "v000002" / "_manifest.json").read_text() == published


def test_a_second_run_of_the_same_model_is_refused_naming_the_run_that_holds_it(prefect_api, make_spec, tmp_path):
    """Item 17: while a run of the model holds its lock, another `pipeline` of the same spec waits,
    then is refused naming that run, having trained and registered nothing."""
    from trnflow.flows._lock import model_lock

    spec = make_spec(name="onejob")
    with model_lock("onejob", timeout_seconds=10, who="run nightly-7 (flow run 'tidy-otter')"):
        state, outcome = _run(spec, lock_timeout_seconds=1)
    assert state.is_failed()
    assert "run nightly-7 (flow run 'tidy-otter') of onejob has held the concurrency limit trnflow-model-onejob" \
        in str(outcome)
    assert not local_path(spec.train.checkpoint_url).exists()
    assert Registry(spec.registry_url).versions("onejob") == []


def _task_run_counts(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {run.name.rsplit("-", 1)[0]: run.run_count for run in runs}


def _evaluate_once(spec, checkpoint):
    """The evaluate stage alone, as the pipeline calls it (with the spec's retry policy)."""
    from prefect import flow

    from trnflow.tasks.evaluate import evaluate_gate
    from trnflow.tasks.retry_policy import retry_options

    @flow
    def evaluate_only():
        return evaluate_gate.with_options(**retry_options(spec))(spec, "evaluate-only", checkpoint)

    state = evaluate_only(return_state=True)
    return state, state.result(raise_on_failure=False)


@pytest.fixture(scope="module")
def reference_checkpoint(prefect_api, dataset, tmp_path_factory, compile_cache, trnflow_home):
    """One trained fp32 checkpoint (the reference run's), shared by the evaluate-stage tests."""
    from tests.conftest import quickstart_data
    from trnflow.specs import validate_spec

    root = tmp_path_factory.mktemp("evaluate")
    spec = validate_spec(quickstart_data(
        name="evalonly",
        data={"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
              "inference": str(dataset / "inference")},
        compute={"cores_per_node": 1},  # what it trains and evaluates, not on how many ranks
        train={"steps": 20, "checkpoint_every": 20, "global_batch_size": 16, "checkpoint_url": str(root / "ckpt")},
        compile={"cache_url": str(compile_cache)},
        gate={"reference": str(root / "reference" / "metrics.json")},
        inference={"output_url": str(root / "embeddings")},
        registry_url=str(root / "registry"),
    ))
    document = run_reference(spec)
    assert json.loads(local_path(spec.gate.reference).read_text()) == document.model_dump(mode="json",
                                                                                          exclude_none=True)
    return spec, document.checkpoint


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
    assert "baseline" in result.summary
    assert result.points[0].step == 20


def test_evaluation_matches_the_reference_it_came_from(reference_checkpoint):
    spec, checkpoint = reference_checkpoint
    state, result = _evaluate_once(spec, checkpoint)
    assert state.is_completed(), result
    assert result.verdict.passed and result.verdict.points[0].diff == 0.0
    series = json.loads((local_path(checkpoint).parent / "metrics.json").read_text())
    assert [p["step"] for p in series["points"]] == [20]


def test_a_gate_on_loss_judges_it_lower_is_better_within_a_relative_band(reference_checkpoint, tmp_path):
    """gate.metric loss with max_rel_diff 1%: a reference whose loss is 0.5% away passes, one 2% away
    fails; the series records loss as lower-is-better, and McNemar's test (for accuracy) is not run."""
    spec, checkpoint = reference_checkpoint
    reference = json.loads(local_path(spec.gate.reference).read_text())

    def judged(scale: float):
        moved = {**reference, "points": [{**p, "loss": p["loss"] * scale} for p in reference["points"]]}
        (tmp_path / f"ref-{scale}.json").write_text(json.dumps(moved))
        gate = {**spec.gate.model_dump(exclude={"max_abs_diff"}), "metric": "loss", "metrics": [],
                "max_rel_diff": 0.01, "reference": str(tmp_path / f"ref-{scale}.json")}
        return _evaluate_once(spec.model_copy(update={"gate": type(spec.gate).model_validate(gate)}), checkpoint)

    state, result = judged(1.005)
    assert state.is_completed(), result
    verdict = result.verdict
    assert (verdict.metric, verdict.better, verdict.max_rel_diff, verdict.passed) == ("loss", "lower", 0.01, True)
    assert verdict.points[0].diff == pytest.approx(-0.005 / 1.005 * verdict.points[0].reference, rel=1e-6)
    assert verdict.paired.available is False  # McNemar's test speaks to accuracy only
    state, error = judged(1.02)
    assert state.is_failed() and "allowed ±1% of the reference" in str(error)
    series = json.loads((local_path(checkpoint).parent / "metrics.json").read_text())
    assert {k: v for k, v in series["directions"].items() if k in ("accuracy", "loss")} == {
        "accuracy": "higher", "loss": "lower"}  # written with every point's metrics, by the training run
