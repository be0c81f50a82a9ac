"""hf-causal-lm through the six stages on the emulator: fine-tuned from a pretrained decoder and
its own tokenizer on prompt/completion rows, gated on perplexity (lower is better), its inference
scoring each completion given its prompt, and its export loading and generating with transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest
import torch

from tests.pretrained import tiny_causal_lm
from trnflow.flows.pipeline import STAGES, pipeline
from trnflow.lifecycle.registry import Registry
from trnflow.storage.base import local_path
from trnflow.workload.checkpoint import load
from trnflow.workload.recipes import recipe_for
from trnflow.workload.synth import synthesize

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    synthesize(root, days=1, rows_per_day=320, seed=5, fmt="prompt-completion", holdout_rows=96, inference_rows=50)
    return root


def _rows(folder: Path) -> pa.Table:
    return pa.concat_tables([pajson.read_json(f) for f in sorted(folder.rglob("*.jsonl"))])


EXAMPLE = Path(__file__).parents[2] / "jobspecs" / "examples" / "causal-lm.yaml"


def _example(folder: Path, prompts: Path, out: Path, **changes) -> dict:
    """The fine-tuning example's spec, with its pretrained folder, data and outputs moved."""
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["params"]["pretrained"] = str(folder)
    data["data"].update({part: str(prompts / part) for part in ("train", "holdout", "inference")})
    data["compile"]["cache_url"] = str(out / "lm-cache")
    data["train"]["checkpoint_url"] = str(out / "checkpoints")
    data["gate"]["reference"] = str(out / "reference" / "metrics.json")
    data["registry_url"] = str(out / "registry")
    data["inference"]["output_url"] = str(out / "scores")
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    return data


def _six_stages(spec) -> dict:
    """The pipeline run on `spec`, every stage completed: its results."""
    state = pipeline(spec, return_state=True)
    outcome = state.result(raise_on_failure=False).model_dump(mode="json")
    assert state.is_completed(), outcome
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
    return outcome["results"]


def test_a_pretrained_decoder_is_fine_tuned_gated_on_perplexity_and_exported(prefect_api, tmp_path, prompts,
                                                                            trnflow_home):
    """The example spec file on the emulator, at its default optlevel (2: generated kernels) with an
    evaluation in the middle of training: bf16 training held within 2% of the perplexity of an fp32
    reference run at every evaluation, then inference and the export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trnflow.backends.reference import run_reference
    from trnflow.specs import validate_spec

    train = _rows(prompts / "train")
    texts = train.column("prompt").to_pylist() + train.column("completion").to_pylist()
    folder = tiny_causal_lm(tmp_path / "pretrained", texts)
    spec = validate_spec(_example(folder, prompts, tmp_path, model={"params": {
        "pretrained": str(folder), "seq_len": 64, "rows": "prompt-completion"}}, train={"steps": 40, "lr": 0.003,
        "checkpoint_every": 20}, gate={"eval_every": 20}, inference={"shard_size": 30}))
    # the fp32 reference's own graphs at optlevel 1: the candidate's, at 2, are what this test is about
    reference = run_reference(spec.model_copy(update={"compile": spec.compile.model_copy(update={"optlevel": 1})}))
    assert [p["step"] for p in reference["points"]] == [20, 40]
    results = _six_stages(spec)
    points = results["evaluate"]["points"]
    assert [p["step"] for p in points] == [20, 40]
    assert all(set(p) >= {"loss", "perplexity", "token_accuracy"} and "accuracy" not in p for p in points)
    assert all(p["perplexity"] == pytest.approx(math.exp(p["loss"])) for p in points)
    verdict = results["evaluate"]["verdict"]
    assert (verdict["metric"], verdict["better"], verdict["max_rel_diff"]) == ("perplexity", "lower", 0.02)
    assert verdict["passed"] and [p["step"] for p in verdict["points"]] == [20, 40]
    assert all(p["diff"] != 0 for p in verdict["points"])  # bf16 against fp32: close, not equal

    # fine-tuning lowered the holdout perplexity from the starting model's
    recipe = recipe_for(spec)
    ckpt = load(results["train"]["checkpoint"])
    recipe.load(ckpt.featurizer, ckpt.url)
    holdout = recipe.features(_rows(prompts / "holdout"))
    start = recipe.build_model().eval()
    with torch.no_grad():
        before = recipe.evaluate(start(holdout).double(), torch.zeros(len(holdout)), [])["perplexity"]
    assert points[-1]["perplexity"] < 0.8 * before, (points, before)

    # inference scores each completion given its prompt
    shard = results["infer"]["shards"][0]["file"]
    table = pq.read_table(local_path(f"{results['infer']['output_url']}/{shard}"))
    assert table.column_names == ["id", "embedding", "log_likelihood", "perplexity", "tokens", "model_version"]
    assert len(table.column("embedding")[0]) == 32 and results["infer"]["rows"] == 50
    tokens = table.column("tokens").to_pylist()
    assert all(n >= 2 for n in tokens)  # the completion's word and the end of sequence
    assert all(p == pytest.approx(math.exp(-ll / n), rel=1e-5) for p, ll, n in zip(
        table.column("perplexity").to_pylist(), table.column("log_likelihood").to_pylist(), tokens, strict=True))

    # the champion's export loads with transformers and continues a prompt from the trained logits
    champion = Registry(spec.registry_url).champion(spec.name)
    export = local_path(champion.entry.export)
    assert json.loads((export / "trnflow.json").read_text())["recipe"] == "hf-causal-lm"
    lm = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    trained = recipe.build_model()
    trained.load_state_dict(ckpt.model)
    prompt = tokenizer(_rows(prompts / "holdout").column("prompt")[0].as_py(), return_tensors="pt")
    with torch.no_grad():
        theirs = lm(**prompt).logits[0, -1]
        torch.testing.assert_close(theirs, trained.eval().lm(**prompt).logits[0, -1])
        generated = lm.generate(**prompt, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    word = tokenizer.decode(generated[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert word.split()[0] in ("positive", "negative"), word  # it learned what follows "Sentiment:"


def test_fine_tuning_lowers_holdout_perplexity_from_the_starting_models_on_three_seeds(make_spec, tmp_path,
                                                                                     prompts, trnflow_home):
    """The training stage alone, compiled once, then run with three seeds: each ends with a holdout
    perplexity well below the pretrained model's."""
    from trnflow.backends import JobRequest, JobState, wait
    from trnflow.backends.local import LocalBackend
    from trnflow.settings import TrnflowSettings

    train = _rows(prompts / "train")
    folder = tiny_causal_lm(tmp_path / "pretrained", train.column("prompt").to_pylist()
                            + train.column("completion").to_pylist())
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    spec = make_spec(
        model={"recipe": "hf-causal-lm", "params": {"pretrained": str(folder), "seq_len": 64}},
        data={"train": str(prompts / "train"), "holdout": str(prompts / "holdout"),
              "inference": str(prompts / "inference")},
        compile={"cache_url": str(tmp_path / "lm-cache"), "optlevel": 1},
        train={"steps": 30, "checkpoint_every": 30, "lr": 0.003},
        gate={"metric": "perplexity", "metrics": [], "reference": None, "eval_every": None})
    compiled = wait(backend, backend.submit(JobRequest(spec, "compile", "seeds", processes=1)), 0.2)
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    recipe = recipe_for(spec)
    recipe.fit(train)  # the folder's own tokenizer: the same for every seed
    holdout = recipe.features(_rows(prompts / "holdout"))
    with torch.no_grad():
        start = recipe.evaluate(recipe.build_model().eval()(holdout).double(), torch.zeros(len(holdout)), [])
    tuned = {}
    for seed in (1, 2, 3):
        seeded = spec.model_copy(update={"train": spec.train.model_copy(update={
            "seed": seed, "checkpoint_url": str(tmp_path / f"checkpoints-{seed}")})})
        job = wait(backend, backend.submit(JobRequest(seeded, "train", f"seed-{seed}")), 0.2)
        assert job.state is JobState.SUCCEEDED, job.failure
        tuned[seed] = job.result.evaluations[-1]["perplexity"]
    assert len(set(tuned.values())) == 3, tuned  # three different runs
    assert all(p < 0.8 * start["perplexity"] for p in tuned.values()), (start, tuned)


def test_the_example_runs_on_the_mock_sagemaker(prefect_api, moto_endpoint, tmp_path, monkeypatch, prompts):
    """jobspecs/examples/causal-lm.yaml on SageMaker (the mock cloud), its data and outputs on S3, its
    pretrained folder local to the containers: six stages, gated on perplexity."""
    import yaml

    from tests.clouds import in_cloud
    from trnflow.specs import validate_spec

    train = _rows(prompts / "train")
    folder = tiny_causal_lm(tmp_path / "pretrained", train.column("prompt").to_pylist()
                            + train.column("completion").to_pylist())
    data = yaml.safe_load((Path(__file__).parents[2] / "jobspecs" / "examples" / "causal-lm.yaml").read_text())
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, prompts, in_process=True) as (_, bucket):
        s3 = f"s3://{bucket}"
        data["model"]["params"]["pretrained"] = str(folder)
        data["data"].update({part: f"{s3}/reviews/{part}" for part in ("train", "holdout", "inference")})
        data["compute"]["backend"] = "sagemaker"
        data["compile"].update(cache_url=f"{s3}/lm-cache", optlevel=1)  # the default optlevel: the first test's
        data["train"].update(steps=20, checkpoint_every=20, checkpoint_url=f"{s3}/checkpoints")
        data["gate"].update(reference="champion", eval_every=None)
        data.update(registry_url=f"{s3}/registry", inference={**data["inference"], "output_url": f"{s3}/scores"})
        spec = validate_spec(data)
        results = _six_stages(spec)
        assert results["train"]["recipe"]["recipe"] == "hf-causal-lm"
        assert results["evaluate"]["verdict"]["metric"] == "perplexity"
        assert results["infer"]["rows"] == 50 and Registry(spec.registry_url).champion(spec.name).entry.export
