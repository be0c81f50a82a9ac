"""LoRA training on the emulator: checkpoints hold the adapters and their optimizer state alone, a
rank killed mid-run resumes bitwise under ddp and fsdp, a checkpoint resumes on another number of
cores, a checkpoint is refused on another base, naming both digests, and the LoRA example runs the
six stages on chats and exports both ways."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.integration.test_causal_lm import _rows, _six_stages
from tests.pretrained import tiny_causal_lm
from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.lifecycle.registry import Registry
from trnflow.settings import TrnflowSettings
from trnflow.storage.base import local_path
from trnflow.workload.checkpoint import load
from trnflow.workload.recipes import recipe_for
from trnflow.workload.recipes.lora import folder_digest
from trnflow.workload.synth import synthesize

pytestmark = pytest.mark.slow

LORA = {"r": 4, "alpha": 8}


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _lm(make_spec, folder, cores: int = 2, faults=(), **train):
    return make_spec(cores, model={"recipe": "hf-causal-lm", "params": {
        "pretrained": str(folder), "seq_len": 32, "rows": "text", "lora": LORA}},
        gate={"metric": "perplexity", "metrics": []}, faults=list(faults),
        train={"steps": 8, "checkpoint_every": 4, "log_every": 1, "global_batch_size": 16, **train})


def _train(backend, spec, run_id):
    return wait(backend, backend.submit(JobRequest(spec, "train", run_id)), 0.2)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_killed_lora_run_resumes_to_the_weights_of_one_never_killed(make_spec, backend, decoder, strategy):
    parallel = {"parallelism": {"strategy": strategy}}
    killed = _lm(make_spec, decoder, faults=[{"kind": "kill", "core": 1, "step": 6, "phase": "train"}], **parallel)
    failed = _train(backend, killed, "lora")
    assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
    resumed = _train(backend, killed, "lora")
    assert resumed.state is JobState.SUCCEEDED, resumed.failure
    assert resumed.result.start_step == 4 and resumed.result.resumed_from

    whole = _train(backend, _lm(make_spec, decoder, **parallel), "lora-whole")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    ours, theirs = load(resumed.result.checkpoint), load(whole.result.checkpoint)
    assert ours.model.keys() == theirs.model.keys()
    assert all(torch.equal(ours.model[k], theirs.model[k]) for k in ours.model)
    # the adapters alone, and the base named by its digest
    assert ours.model and all(".lora_A." in k or ".lora_B." in k for k in ours.model)
    assert ours.meta.base == folder_digest(decoder) and ours.meta.parallelism == strategy
    middle = load(resumed.result.resumed_from)
    if strategy == "ddp":
        assert len(middle.optim["state"]) == len(ours.model)  # optimizer state of the adapters only
    else:
        assert middle.sharded and all("lora_" in name or name == ".metadata" or name.endswith(".distcp")
                                      for name in middle.shards)


def test_a_lora_checkpoint_resumes_on_another_number_of_cores(make_spec, backend, decoder):
    """Saved by 2 ranks at step 4, resumed on 1: the next steps' losses match a run on 1 that never
    stopped within 1e-6."""
    first = _lm(make_spec, decoder, faults=[{"kind": "timeout", "core": 1, "step": 6, "phase": "train"}])
    failed = _train(backend, first, "lora-reshard")
    assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
    info = _train(backend, _lm(make_spec, decoder, cores=1), "lora-reshard")
    assert info.state is JobState.SUCCEEDED, info.failure
    assert info.result.start_step == 4
    whole = _train(backend, _lm(make_spec, decoder, cores=1), "lora-reshard-whole")
    ours = {p["step"]: p["loss"] for p in info.result.curve if p["step"] > 4}
    theirs = {p["step"]: p["loss"] for p in whole.result.curve}
    assert sorted(ours) == [5, 6, 7, 8]
    for step, loss in ours.items():
        assert loss == pytest.approx(theirs[step], rel=1e-6), (step, loss, theirs[step])


def test_a_lora_checkpoint_is_refused_on_another_base_naming_both(make_spec, backend, decoder, tmp_path):
    trained = _train(backend, _lm(make_spec, decoder, cores=1, steps=4), "lora-first")
    assert trained.state is JobState.SUCCEEDED, trained.failure
    other = tmp_path / "other-base"
    shutil.copytree(decoder, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("}", ', "note": 1}', 1))
    again = _train(backend, _lm(make_spec, other, cores=1, steps=4, init_from=trained.result.checkpoint),
                   "lora-second")
    assert again.state is JobState.FAILED and not again.failure.retryable
    assert folder_digest(decoder) in again.failure.message and folder_digest(other) in again.failure.message


LORA_EXAMPLE = Path(__file__).parents[2] / "jobspecs" / "examples" / "causal-lm-lora.yaml"


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("chats")
    synthesize(root, days=1, rows_per_day=320, seed=5, fmt="chat", holdout_rows=96, inference_rows=50)
    return root


def test_the_lora_example_fine_tunes_adapters_on_chats_gated_and_exported_both_ways(prefect_api, tmp_path, chats,
                                                                                   trnflow_home):
    """jobspecs/examples/causal-lm-lora.yaml on the emulator: adapters on a
    frozen pretrained decoder, trained on chats, held within 2% of an fp32 reference's perplexity at
    every evaluation; checkpoints hold the adapters alone; the registry names the base; the export
    loads merged with transformers and as an adapter with peft, and `trnflow models export
    --adapter` copies the adapter alone."""
    import peft
    import yaml
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from trnflow.backends.reference import run_reference
    from trnflow.cli.app import app
    from trnflow.specs import validate_spec
    from trnflow.workload.recipes.lora import folder_digest

    texts = [t["content"] for row in _rows(chats / "train").column("messages").to_pylist() for t in row]
    folder = tiny_causal_lm(tmp_path / "pretrained", texts)
    data = yaml.safe_load(LORA_EXAMPLE.read_text())
    assert data["model"]["params"]["lora"]
    data["model"]["params"]["pretrained"] = str(folder)
    data["data"].update({part: str(chats / part) for part in ("train", "holdout", "inference")})
    # graphs lowered without generated kernels: the example at its default optlevel is the test above's
    data["compile"].update(cache_url=str(tmp_path / "lm-cache"), optlevel=1)
    data["train"].update(steps=40, checkpoint_every=20, checkpoint_url=str(tmp_path / "checkpoints"))
    data["gate"].update(eval_every=20, reference=str(tmp_path / "reference" / "metrics.json"))
    data.update(registry_url=str(tmp_path / "registry"),
                inference={**data["inference"], "output_url": str(tmp_path / "scores"), "shard_size": 30})
    spec = validate_spec(data)
    run_reference(spec)
    results = _six_stages(spec)
    verdict = results["evaluate"]["verdict"]
    assert verdict["passed"] and [p["step"] for p in verdict["points"]] == [20, 40]
    assert results["infer"]["rows"] == 50

    # each chat's last assistant turn generated anew, beside its log-likelihood: words the assistant
    # says (after 40 steps on a tiny decoder it has learned the answers' form, not yet each review's)
    table = pa.concat_tables(pq.read_table(local_path(f"{results['infer']['output_url']}/{s['file']}"))
                             for s in results["infer"]["shards"])
    assert {"log_likelihood", "completion", "completion_tokens"} <= set(table.column_names)
    rows = {r["id"]: r["messages"] for r in _rows(chats / "inference").to_pylist()}
    said = {i: c.strip() for i, c in zip(table.column("id").to_pylist(), table.column("completion").to_pylist(),
                                         strict=True)}
    answers = {turn["content"].split()[0] for chat in rows.values() for turn in chat if turn["role"] == "assistant"}
    assert answers == {"positive", "negative", "Yes:"}
    first = [(c.split() or [""])[0] for c in said.values()]
    assert sum(word in answers for word in first) >= 0.8 * len(first), sorted(said.items())[:5]

    ckpt = load(results["train"]["checkpoint"])
    assert ckpt.model and all("lora_" in k for k in ckpt.model) and ckpt.meta.base == folder_digest(folder)
    recipe = recipe_for(spec)
    recipe.load(ckpt.featurizer, ckpt.url)
    holdout = recipe.features(_rows(chats / "holdout"))
    with torch.no_grad():
        before = recipe.evaluate(recipe.build_model().eval()(holdout).double(), torch.zeros(len(holdout)), [])
    assert results["evaluate"]["points"][-1]["perplexity"] < 0.8 * before["perplexity"]

    champion = Registry(spec.registry_url).champion(spec.name)
    assert champion.entry.base == folder_digest(folder)
    export = local_path(champion.entry.export)
    trained = recipe.build_model()
    trained.load_state_dict(ckpt.model, strict=False)
    ids = holdout[:4, 0]
    adapter = tmp_path / "adapter"
    copied = CliRunner().invoke(app, ["models", "export", spec.name, str(adapter), "--adapter", "-r",
                                      spec.registry_url, "--json"])
    assert copied.exit_code == 0, copied.output
    assert json.loads(copied.stdout)["base"] == folder_digest(folder)
    assert {p.name for p in adapter.iterdir()} >= {"EXPORTED", "adapter_config.json", "adapter_model.safetensors"}
    assert not any(p.suffix == ".safetensors" and p.name != "adapter_model.safetensors" for p in adapter.iterdir())
    with torch.no_grad():
        want = trained.eval().lm(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        base = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
        adapted = peft.PeftModel.from_pretrained(base, adapter).eval()
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
