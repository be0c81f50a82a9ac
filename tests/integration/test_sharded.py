"""Sharded training (`train.parallelism.strategy: fsdp`) on the emulator: each rank holds half of
the state, a killed run resumes bitwise, and a checkpoint resumes on another number of cores."""

from __future__ import annotations

import pytest
import torch

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.workload.checkpoint import load, weights_digest
from trnflow.workload.memory import REHEARSAL_CORE_ENV, plan
from trnflow.workload.sharding import consolidate

FSDP = {"parallelism": {"strategy": "fsdp"}}


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _train(backend, spec, run_id):
    return wait(backend, backend.submit(JobRequest(spec, "train", run_id)), 0.2)


def _state_bytes(memory: dict) -> int:
    return memory["weights"] + memory["optimizer"]


def test_auto_shards_a_model_too_big_for_a_core_and_each_rank_holds_half_of_it(make_spec, backend, monkeypatch):
    """A rehearsed core smaller than the model's ddp needs: `auto` takes fsdp. Each of the two ranks
    then holds half of the weights and optimizer state that ddp holds on each (within 10%), as the
    plan estimated, and a kill mid-run resumes to the weights of a run never killed."""
    spec = make_spec(train={"steps": 12, "checkpoint_every": 4, "log_every": 4})
    both = plan(spec)
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str((both.ddp.total + both.fsdp.total) / 2 / 1024**3))
    killed = make_spec(train={"steps": 12, "checkpoint_every": 4, "log_every": 4},
                       faults=[{"kind": "kill", "core": 1, "step": 6, "phase": "train"}])
    failed = _train(backend, killed, "sharded")
    assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
    resumed = _train(backend, killed, "sharded")
    assert resumed.state is JobState.SUCCEEDED, resumed.failure
    assert resumed.result.start_step == 4 and resumed.result.resumed_from
    final = load(resumed.result.checkpoint)
    assert final.meta.parallelism == "fsdp"
    # each rank wrote its own shard; the last checkpoint holds the weights whole too, joined as its shards say
    assert sorted(final.shards) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert weights_digest(final.model) == weights_digest(consolidate(final.shards)[0])
    middle = load(resumed.result.resumed_from)
    assert middle.sharded and not middle.consolidated and final.consolidated  # model.pt at the last step only

    whole = _train(backend, spec, "sharded-whole")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    ours, theirs = load(resumed.result.checkpoint).model, load(whole.result.checkpoint).model
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    measured = _state_bytes(whole.result.device_memory.model_dump())
    assert measured == pytest.approx(_state_bytes(both.ddp.model_dump()) / 2, rel=0.1)
    assert measured == pytest.approx(_state_bytes(both.fsdp.model_dump()), rel=0.1)  # the plan's figure


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed"), [(4, 2), (2, 4)])
def test_a_sharded_checkpoint_resumes_on_another_number_of_cores(make_spec, backend, saved, resumed):
    """Saved by `saved` ranks at step 4, resumed on `resumed` from the same step and sample: the
    next steps' losses match a run that never stopped, within 1e-6 (the state was resharded; the
    gradients summed in another order)."""
    train = {"steps": 8, "checkpoint_every": 4, "log_every": 1, "global_batch_size": 32, **FSDP}
    compute = {"instance_type": "trn1.32xlarge"}
    first = make_spec(compute={**compute, "cores_per_node": saved}, train=train,
                      faults=[{"kind": "timeout", "core": saved - 1, "step": 6, "phase": "train"}])
    failed = _train(backend, first, "reshard")
    assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
    info = _train(backend, make_spec(compute={**compute, "cores_per_node": resumed}, train=train), "reshard")
    assert info.state is JobState.SUCCEEDED, info.failure
    assert info.result.start_step == 4 and load(info.result.checkpoint).meta.world_size == resumed
    assert len(load(info.result.resumed_from).shards) == saved + 1  # its shards and their index
    # rank 0 logs the loss of its part of the batch: the part it has at `resumed` ranks
    whole = _train(backend, make_spec(compute={**compute, "cores_per_node": resumed}, train=train), "reshard-whole")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    ours = {p.step: p.loss for p in info.result.curve if p.step > 4}  # the steps trained after resuming
    theirs = {p.step: p.loss for p in whole.result.curve}
    assert sorted(ours) == [5, 6, 7, 8]
    for step, loss in ours.items():
        assert loss == pytest.approx(theirs[step], rel=1e-6), (step, loss, theirs[step])


@pytest.mark.slow
def test_a_checkpoint_resumes_under_the_other_strategy_both_ways(make_spec, backend):
    """A ddp checkpoint (its optimizer state by position) resumes sharded, and a sharded one (by
    name) resumes under ddp: the same step, the same weights, and the run goes on to its end."""
    train = {"steps": 8, "checkpoint_every": 4, "log_every": 4}
    for first, then in (("ddp", "fsdp"), ("fsdp", "ddp")):
        run = f"{first}-then-{then}"
        stopped = make_spec(train={**train, "parallelism": {"strategy": first}},
                            faults=[{"kind": "timeout", "core": 1, "step": 6, "phase": "train"}])
        failed = _train(backend, stopped, run)
        assert failed.state is JobState.FAILED and failed.failure.retryable, failed.failure
        saved = load(f"{stopped.train.checkpoint_url}/{run}/step-000004")
        assert saved.meta.parallelism == first
        info = _train(backend, make_spec(train={**train, "parallelism": {"strategy": then}}), run)
        assert info.state is JobState.SUCCEEDED, info.failure
        assert info.result.start_step == 4 and info.result.resumed_from == saved.url
        assert info.result.resumed_weights == weights_digest(saved.model)  # loaded as saved
        assert load(info.result.checkpoint).meta.parallelism == then
