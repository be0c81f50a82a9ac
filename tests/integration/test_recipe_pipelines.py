"""Recipes other than m5-text through the six stages. A model from outside trnflow, the example
recipe `tabular-mlp` (examples/recipes, installed as a package of its own), on two Batch nodes in
the mock cloud: each node's container finds the plug-in as the local backend's workers do (the XLA
lane runs it locally, on the xla device), and as a SageMaker container would. And the built-in
`hf-encoder` on SageMaker, whose export loads with transformers' own `from_pretrained`. The gate,
the registry's promotion and the published predictions or embeddings are checked."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from tests.clouds import in_cloud, s3_keys
from tests.pretrained import tiny_encoder
from trnflow.flows.pipeline import STAGES, pipeline
from trnflow.lifecycle.registry import Registry
from trnflow.specs import validate_spec
from trnflow.workload.checkpoint import load
from trnflow.workload.recipes import recipe_for
from trnflow.workload.recipes.hf_pretrained import saved_state

SPEC = Path(__file__).resolve().parents[2] / "examples" / "recipes" / "tabular.yaml"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tabular(tmp_path_factory) -> Path:
    """Two days of numeric rows, a holdout and an inference set, written by the recipe's own generator."""
    import numpy as np
    from tabular_recipe.data import rows

    root = tmp_path_factory.mktemp("tabular")
    rng = np.random.default_rng(11)
    for day, name in enumerate(("dt=2026-01-01", "dt=2026-01-02")):
        (root / "train" / name).mkdir(parents=True)
        pq.write_table(rows(rng, 400, day * 400, True), root / "train" / name / "part-00000.parquet")
    for name, n, labelled in (("holdout", 300, True), ("inference", 230, False)):
        (root / name).mkdir()
        pq.write_table(rows(rng, n, 1_000_000, labelled), root / name / "part-00000.parquet")
    return root


def _spec(root: str, out: str, **compute):
    data = yaml.safe_load(SPEC.read_text())
    data["data"].update(train=f"{root}/train", holdout=f"{root}/holdout", inference=f"{root}/inference")
    data["compute"].update(compute)
    data["compile"]["cache_url"] = f"{out}/compile-cache"
    data["train"].update(steps=40, checkpoint_every=20, log_every=10, checkpoint_url=f"{out}/checkpoints")
    data["gate"].update(reference="champion", eval_every=20)
    data["inference"].update(output_url=f"{out}/predictions", shard_size=100)
    data["registry_url"] = f"{out}/registry"
    data["retries"] = {"max_retries": 1, "backoff_seconds": 0.5}
    return validate_spec(data)


def _check_outcome(outcome, spec, read: callable) -> dict:
    """Every stage completed; the model was trained by the recipe, registered and promoted; each
    inference row has a prediction and class probabilities. `read(url)` gives a file's bytes."""
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES], outcome
    results = outcome["results"]
    train = results["train"]
    assert train["recipe"]["recipe"] == "tabular-mlp" and train["recipe"]["version"] == "1"
    assert train["compile"]["recompiles"] == [] and train["compile"]["hits"] == train["compile"]["graphs"]
    assert results["compile"]["graphs"] == 2  # training and evaluation: no embedding program
    assert results["evaluate"]["verdict"]["passed"] is True
    assert results["promote"]["version"] == results["evaluate"]["registry"]["version"]
    assert results["infer"]["published"] == "predictions" and results["infer"]["rows"] == 230
    meta = json.loads(read(f"{train['checkpoint']}/meta.json"))
    assert meta["recipe"]["params"]["features"] == ["f0", "f1", "f2", "f3"]
    scaler = json.loads(read(f"{train['checkpoint']}/scaler.json"))
    assert len(scaler["mean"]) == 4 and all(s > 0 for s in scaler["std"])
    champion = Registry(spec.registry_url).champion(spec.name)
    assert champion is not None and champion.entry.recipe.recipe == "tabular-mlp"
    shard = results["infer"]["shards"][0]["file"]
    table = pq.read_table(io.BytesIO(read(f"{results['infer']['output_url']}/{shard}")))
    assert table.column_names == ["id", "prediction", "probabilities", "model_version"]
    assert set(table.column("prediction").to_pylist()) <= {0, 1}
    assert all(abs(sum(p) - 1) < 1e-5 for p in table.column("probabilities").to_pylist())
    return results


def test_the_external_recipe_runs_on_two_batch_nodes(prefect_api, moto_endpoint, tmp_path, monkeypatch, tabular):
    import boto3

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, tabular, in_process=False) as (_, bucket):
        compute = {"backend": "batch", "instance_type": "trn1.32xlarge", "nodes": 2, "cores_per_node": 1,
                   "share_identifier": "default", "fair_share": True}
        spec = _spec(f"s3://{bucket}/reviews", f"s3://{bucket}/tabular", **compute)
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        s3 = boto3.client("s3")

        def read(url: str) -> bytes:
            key = url.removeprefix(f"s3://{bucket}/")
            return s3.get_object(Bucket=bucket, Key=key)["Body"].read()

        results = _check_outcome(outcome.model_dump(mode="json"), spec, read)
        assert results["evaluate"]["points"][-1]["accuracy"] > 0.8  # the columns decide the label
        assert any(k.endswith("/scaler.json") for k in s3_keys(s3, bucket, "tabular/checkpoints/"))
        assert load(results["train"]["checkpoint"], "scaler.json").featurizer_file == "scaler.json"


SEQ_LEN = 24


def _hf_spec(make_spec, tmp_path, pretrained: Path, cache_url: str, **sections):
    return make_spec(model={"recipe": "hf-encoder", "params": {"pretrained": str(pretrained), "seq_len": SEQ_LEN}},
                     compile={"cache_url": cache_url},
                     train={"steps": 20, "checkpoint_every": 20, "log_every": 10, **sections.pop("train", {})},
                     gate={"reference": "champion", "eval_every": None}, **sections)


def _check_export(read_dir: Path, checkpoint_state: dict) -> None:
    """The exported encoder loads with transformers' own from_pretrained, with the trained weights."""
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(read_dir, local_files_only=True)
    trained = {k.removeprefix("encoder."): v for k, v in checkpoint_state.items() if k.startswith("encoder.")}
    loaded = encoder.state_dict()
    assert trained and all(torch.equal(loaded[k], v) for k, v in trained.items())


def test_the_hugging_face_encoder_runs_the_six_stages_on_sagemaker_and_exports_with_save_pretrained(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Fine-tuned from a pretrained folder with a tokenizer of its own: the checkpoints' featurizer
    is that tokenizer, and the export's tokenizer gives the same token ids."""
    import boto3
    import pyarrow.json as pajson
    from transformers import AutoTokenizer

    texts = [t for f in sorted((dataset / "train").rglob("*.jsonl"))
             for t in pajson.read_json(f).column("text").to_pylist()]
    folder = tiny_encoder(tmp_path / "pretrained", texts[:500])
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, in_process=True) as (_, bucket):
        s3 = f"s3://{bucket}"
        reviews = {part: f"{s3}/reviews/{part}" for part in ("train", "holdout", "inference")}
        spec = _hf_spec(make_spec, tmp_path, folder, f"{s3}/hf-cache", data=reviews,
                        compute={"backend": "sagemaker", "cores_per_node": 1},  # ranks are other tests' concern
                        registry_url=f"{s3}/registry", inference={"output_url": f"{s3}/embeddings"},
                        train={"checkpoint_url": f"{s3}/checkpoints", "global_batch_size": 16})
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False).model_dump(mode="json")
        assert state.is_completed(), outcome
        assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
        results = outcome["results"]
        assert results["train"]["recipe"]["recipe"] == "hf-encoder"
        assert results["promote"]["version"] == results["evaluate"]["registry"]["version"]
        assert results["infer"]["published"] == "embeddings"
        champion = Registry(spec.registry_url).champion(spec.name)
        prefix = champion.entry.export.removeprefix(f"{s3}/")
        client = boto3.client("s3")
        folder = tmp_path / "export"
        folder.mkdir()
        for key in s3_keys(client, bucket, f"{prefix}/"):
            client.download_file(bucket, key, str(folder / key.rsplit("/", 1)[-1]))
        assert {"config.json", "model.safetensors", "head.pt", "tokenizer.json", "tokenizer_config.json",
                "EXPORTED"} <= {p.name for p in folder.iterdir()}
        ckpt = load(results["train"]["checkpoint"])
        _check_export(folder, ckpt.model)
        assert saved_state(ckpt.featurizer) is not None  # the pretrained tokenizer, not a trained one
        recipe = recipe_for(spec)
        recipe.load(ckpt.featurizer, ckpt.url)
        sample = pa.table({"text": texts[:16]})
        for tokenizer_folder in (tmp_path / "pretrained", folder):  # the starting model's, and the export's
            ids = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)(
                texts[:16], padding="max_length", truncation=True, max_length=SEQ_LEN,
                return_tensors="pt")["input_ids"]
            assert torch.equal(recipe.features(sample), ids)
        shard = results["infer"]["shards"][0]["file"]
        key = f"{results['infer']['output_url'].removeprefix(f'{s3}/')}/{shard}"
        table = pq.read_table(io.BytesIO(client.get_object(Bucket=bucket, Key=key)["Body"].read()))
        assert len(table.column("embedding")[0]) == 32  # the pretrained encoder's width
