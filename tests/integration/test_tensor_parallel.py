"""Tensor parallelism (`train.parallelism.tp`) on the emulator: a Llama-style decoder's layers split
over two cores train to the losses of the model whole; composed with ddp and fsdp over the replicas;
a killed run resumes bitwise, and a checkpoint resumes at another tp."""

from __future__ import annotations

import json

import pytest
import torch

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.storage.base import local_path
from trnflow.workload.checkpoint import load

pytestmark = pytest.mark.slow


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _lm(make_spec, folder, cores: int, tp: int, strategy: str = "ddp", faults=(), **train):
    compute = {"instance_type": "trn1.32xlarge"} if cores > 2 else {}
    return make_spec(cores, compute={"cores_per_node": cores, **compute}, model={"recipe": "hf-causal-lm", "params": {
        "pretrained": str(folder), "seq_len": 32, "rows": "text"}},
        gate={"metric": "perplexity", "metrics": []}, faults=list(faults),
        train={"steps": 8, "checkpoint_every": 4, "log_every": 1, "global_batch_size": 16,
               "parallelism": {"strategy": strategy, "tp": tp}, **train})


def _train(backend, spec, run_id):
    return wait(backend, backend.submit(JobRequest(spec, "train", run_id)), 0.2)


@pytest.fixture(scope="module")
def shared_run():
    """`shared_run(backend, spec, run_id)`: the fault-free training run of `spec`, trained the first
    time a test of this file asks for it. Specs that differ only in where they write train to the
    same losses and weights, so the tests that compare with the same run share it (five jobs fewer)."""
    runs: dict[str, object] = {}

    def train(backend, spec, run_id):
        assert not spec.faults, "only a fault-free run is shared"
        key = _outputs_aside(spec)
        if key not in runs:
            runs[key] = _train(backend, spec, run_id)
        return runs[key]

    return train


def _outputs_aside(spec) -> str:
    """The spec without the folders it writes to: what its training computes."""
    data = spec.model_dump(mode="json")
    data["train"].pop("checkpoint_url")
    data["gate"].pop("reference")
    data["inference"].pop("output_url")
    data.pop("registry_url")
    return json.dumps(data, sort_keys=True)


def _losses(info) -> list[float]:
    return [point.loss for point in info.result.curve]


def _trains_as_the_whole_model(backend, whole_spec, split_spec, shared_run):
    """Both runs succeed, with the same losses and the same final weights within 1e-5; the split run's
    checkpoint, for more checks."""
    whole = shared_run(backend, whole_spec, "whole")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    split = shared_run(backend, split_spec, "split")
    assert split.state is JobState.SUCCEEDED, split.failure
    assert _losses(split) == pytest.approx(_losses(whole), abs=1e-5)
    ours, theirs = load(split.result.checkpoint), load(whole.result.checkpoint)
    assert ours.model.keys() == theirs.model.keys()
    assert all(torch.allclose(ours.model[k], theirs.model[k], atol=1e-5) for k in ours.model)
    return ours


def test_layers_split_over_two_cores_train_to_the_losses_of_the_whole_model(make_spec, backend, decoder, shared_run):
    ours = _trains_as_the_whole_model(backend, _lm(make_spec, decoder, 1, 1), _lm(make_spec, decoder, 2, 2),
                                      shared_run)
    assert ours.meta.tp == 2 and ours.sharded


def test_lora_adapters_split_with_their_layers_train_as_the_whole_model(make_spec, backend, decoder, shared_run):
    """The adapters of a split projection split the same way (lora_B of a column-parallel layer,
    lora_A of a row-parallel one); the checkpoint holds the adapters alone, whole, as at tp 1."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}

    def spec(cores, tp):
        return make_spec(cores, model={"recipe": "hf-causal-lm", "params": {
            "pretrained": str(decoder), "seq_len": 32, "rows": "text", "lora": lora}},
            gate={"metric": "perplexity", "metrics": []},
            train={"steps": 4, "checkpoint_every": 4, "log_every": 1, "global_batch_size": 16, "lr": 0.01,
                   "parallelism": {"strategy": "ddp", "tp": tp}})

    ours = _trains_as_the_whole_model(backend, spec(1, 1), spec(2, 2), shared_run)
    assert all("lora_" in k for k in ours.model)
    assert not all(torch.equal(v, torch.zeros_like(v)) for k, v in ours.model.items() if "lora_B" in k)  # trained


GPT2 = {"recipe": "hf-causal-lm", "params": {"model_type": "gpt2", "vocab_size": 300, "seq_len": 32, "rows": "text",
                                              "config": {"n_embd": 32, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.0,
                                                         "embd_pdrop": 0.0, "attn_pdrop": 0.0}}}
BERT = {"recipe": "hf-encoder", "params": {"model_type": "bert", "vocab_size": 300, "seq_len": 32, "config": {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
    "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}}


@pytest.mark.parametrize("model", [GPT2, BERT], ids=["gpt2", "bert"])
def test_gpt2_and_bert_layers_split_over_two_cores_train_as_the_whole_model(make_spec, backend, model, shared_run):
    """GPT-2's fused query, key and value split head by head; BERT's attention and MLP as Llama's.
    (Eight steps: GPT-2's split run is then the one a test below resumes to.)"""
    gate = {"metric": "perplexity", "metrics": []} if model is GPT2 else {"metric": "accuracy"}

    def spec(cores, tp):
        return make_spec(cores, model=model, gate=gate, train={
            "steps": 8, "checkpoint_every": 4, "log_every": 1, "global_batch_size": 16,
            "parallelism": {"strategy": "ddp", "tp": tp}})

    _trains_as_the_whole_model(backend, spec(1, 1), spec(2, 2), shared_run)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_replicas_of_a_split_model_train_to_the_losses_of_one(make_spec, backend, decoder, strategy, shared_run):
    """Four cores: two replicas (ddp or fsdp over the mesh's dp dimension) of the layers split two
    ways. Each replica logs the loss of its half of the batch; together they are the whole batch's."""
    whole = shared_run(backend, _lm(make_spec, decoder, 1, 1, steps=4, checkpoint_every=4), "whole")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    both = _train(backend, _lm(make_spec, decoder, 4, 2, strategy, steps=4, checkpoint_every=4), "2d")
    assert both.state is JobState.SUCCEEDED, both.failure
    ours, theirs = load(both.result.checkpoint), load(whole.result.checkpoint)
    assert (ours.meta.tp, ours.meta.parallelism, ours.meta.world_size) == (2, strategy, 4)
    assert all(torch.allclose(ours.model[k], theirs.model[k], atol=1e-5) for k in ours.model)


def test_a_killed_split_run_resumes_to_the_weights_of_one_never_killed(make_spec, backend, decoder, shared_run):
    """Killed at step 6, it resumes from its step-4 checkpoint, written in the background by each
    rank, to the weights and losses of a run never killed whose checkpoints were written in step."""
    killed = _lm(make_spec, decoder, 2, 2, faults=[{"kind": "kill", "core": 1, "step": 6, "phase": "train"}])
    failed = _train(backend, killed, "tp")
    assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
    resumed = _train(backend, killed, "tp")
    assert resumed.state is JobState.SUCCEEDED, resumed.failure
    assert resumed.result.start_step == 4 and resumed.result.resumed_from
    assert sorted(load(resumed.result.resumed_from).shards) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    # never killed, and checkpointed before training goes on (the killed run's in the background)
    whole = shared_run(backend, _lm(make_spec, decoder, 2, 2, checkpoint_async=False), "tp-whole")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    ours, theirs = load(resumed.result.checkpoint), load(whole.result.checkpoint)
    assert ours.model.keys() == theirs.model.keys()
    assert all(torch.equal(ours.model[k], theirs.model[k]) for k in ours.model)
    assert _losses(resumed)[-4:] == _losses(whole)[-4:]


@pytest.mark.parametrize(("model", "saved", "resumed"), [("llama", 2, 1), ("llama", 1, 2), ("gpt2", 2, 1),
                                                          ("gpt2", 2, 2)])
def test_a_checkpoint_resumes_at_another_tp(make_spec, backend, decoder, model, saved, resumed, shared_run):
    """Saved at step 4 with the layers split `saved` ways on two cores, resumed split `resumed` ways:
    the weights at the end match a run that never stopped, within 1e-6. (GPT-2's fused query, key and
    value, split part by part, are saved whole, and split again as they load.)"""
    def spec(tp, faults=()):
        if model == "llama":
            return _lm(make_spec, decoder, 2, tp, faults=faults)
        return make_spec(2, model=GPT2, gate={"metric": "perplexity", "metrics": []}, faults=list(faults), train={
            "steps": 8, "checkpoint_every": 4, "log_every": 1, "global_batch_size": 16,
            "parallelism": {"strategy": "ddp", "tp": tp}})

    fault = [{"kind": "timeout", "core": 1, "step": 6, "phase": "train"}]
    failed = _train(backend, spec(saved, fault), "retp")
    assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
    info = _train(backend, spec(resumed), "retp")
    assert info.state is JobState.SUCCEEDED, info.failure
    assert info.result.start_step == 4 and load(info.result.checkpoint).meta.tp == resumed
    never = shared_run(backend, spec(saved), "retp-never")
    assert never.state is JobState.SUCCEEDED, never.failure
    ours, theirs = load(info.result.checkpoint), load(never.result.checkpoint)
    assert all(torch.allclose(ours.model[k], theirs.model[k], atol=1e-6) for k in ours.model)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_compile_stage_traces_the_graphs_a_split_run_needs(make_spec, backend, decoder, tmp_path, strategy):
    """The compile stage's trial rehearses rank 0 of a split model in one process (a stand-in group
    of tp ranks): the run then finds every graph it needs in the cache, and none is compiled again,
    its blocks recomputed as training recomputes them (selective: full with split layers is refused). The
    split weights' layout is part of each graph's key: the graphs at tp 1 are other entries."""
    cache = {"cache_url": str(tmp_path / "tp-cache"), "optlevel": 1, "fail_on_recompile": True}
    recompute = "selective"
    spec = _lm(make_spec, decoder, 2, 2, strategy, steps=4, checkpoint_every=4, activation_checkpointing=recompute)
    spec = spec.model_copy(update={"compile": spec.compile.model_copy(update=cache)})
    compiled = wait(backend, backend.submit(JobRequest(spec, "compile", "tp-compile", processes=1)), 0.2)
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    trained = _train(backend, spec, "tp-compiled")
    assert trained.state is JobState.SUCCEEDED, trained.failure
    metrics = trained.result.compile
    assert metrics.recompiles == [] and metrics.hits == metrics.graphs > 0

    whole = _lm(make_spec, decoder, 2, 1, strategy, steps=4, checkpoint_every=4, activation_checkpointing=recompute)
    whole = whole.model_copy(update={"compile": spec.compile})
    refused = _train(backend, whole, "tp1-uncompiled")  # its graphs are not the split model's
    assert refused.state is JobState.FAILED and "compile.max_recompiles" in refused.failure.message


def test_a_split_run_passes_the_six_stages_and_its_checkpoints_consolidate(prefect_api, make_spec, decoder,
                                                                          trnflow_home):
    """Trained with the layers split (tp 2) and sharded over two replicas (4 cores): evaluation and
    inference run on the checkpoint whole, and the registry holds its whole model.pt. A middle
    checkpoint, shards only, consolidates with `trnflow checkpoint consolidate`."""
    from typer.testing import CliRunner

    from trnflow.cli.app import app
    from trnflow.flows.pipeline import STAGES, pipeline
    from trnflow.lifecycle.registry import Registry
    from trnflow.workload.sharding import consolidate

    spec = _lm(make_spec, decoder, 4, 2, "fsdp")
    spec = spec.model_copy(update={
        "gate": spec.gate.model_copy(update={"reference": None}),
        "compile": spec.compile.model_copy(update={"optlevel": 1})})
    state = pipeline(spec, return_state=True)
    outcome = state.result(raise_on_failure=False).model_dump(mode="json")
    assert state.is_completed(), outcome
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
    results = outcome["results"]
    final = load(results["train"]["checkpoint"])
    assert (final.meta.tp, final.meta.parallelism, final.consolidated) == (2, "fsdp", True)
    assert results["infer"]["rows"] > 0 and results["evaluate"]["points"]
    (version,) = Registry(spec.registry_url).versions(spec.name)
    weights = version.entry.weights
    assert weights and weights.startswith(final.url)
    registered = torch.load(local_path(weights), weights_only=True)
    assert registered.keys() == final.model.keys()
    assert all(torch.equal(registered[k], final.model[k]) for k in registered)

    middle = load(f"{final.url.rpartition('/')[0]}/step-000004")
    assert middle.sharded and not middle.consolidated
    said = CliRunner().invoke(app, ["checkpoint", "consolidate", middle.url, "--json"])
    assert said.exit_code == 0, said.output
    joined = load(middle.url)
    assert joined.consolidated
    whole, _ = consolidate(joined.shards)
    assert joined.model.keys() == whole.keys() and all(torch.equal(joined.model[k], whole[k]) for k in whole)
