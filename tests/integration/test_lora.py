"""LoRA training on the emulator: checkpoints hold the adapters and their optimizer state alone, a
rank killed mid-run resumes bitwise under ddp and fsdp, a checkpoint resumes on another number of
cores, and a checkpoint is refused on another base, naming both digests. The LoRA example as `make
causal-lm-lora` runs it, on chats, gated and exported both ways, is test_make_targets.py's."""

from __future__ import annotations

import shutil

import pytest
import torch

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.workload.checkpoint import load
from trnflow.workload.recipes.lora import folder_digest

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
    ours = {p.step: p.loss for p in info.result.curve if p.step > 4}
    theirs = {p.step: p.loss for p in whole.result.curve}
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
