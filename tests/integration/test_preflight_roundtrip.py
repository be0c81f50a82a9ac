"""The preflight's checkpoint round trip: a checkpoint of the spec's model is written where the
run's checkpoints go, read back and deleted before anything trains; a location that cannot take
one fails the preflight, naming it."""

from __future__ import annotations

import pytest

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _sanity(backend, spec, run_id):
    return wait(backend, backend.submit(JobRequest(spec, "sanity", run_id)), 0.2)


def test_the_preflight_writes_a_checkpoint_where_the_run_will_reads_it_back_and_leaves_nothing(
        make_spec, backend, tmp_path):
    spec = make_spec(cores=1)
    info = _sanity(backend, spec, "trip")
    assert info.state is JobState.SUCCEEDED, info.failure
    trip = info.result.checkpoint
    assert trip.passed and trip.url.endswith("/trip/_preflight") and trip.bytes > 0 and trip.layout == "whole"
    run = tmp_path / "checkpoints" / "trip"
    assert not any(p.is_file() for p in run.rglob("*")), sorted(run.rglob("*"))  # nothing left behind

    off = _sanity(backend, make_spec(cores=1, preflight={"checkpoint_round_trip": False}), "no-trip")
    assert off.state is JobState.SUCCEEDED and off.result.checkpoint is None


def test_a_checkpoint_location_that_cannot_take_one_fails_the_preflight_naming_it(make_spec, backend, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    spec = make_spec(cores=1, train={"checkpoint_url": str(tmp_path / "a-file" / "checkpoints")})
    info = _sanity(backend, spec, "blocked")
    assert info.state is JobState.FAILED
    assert info.failure.type == "FatalError" and info.failure.retryable is False
    assert info.failure.message.startswith("train.checkpoint_url: the preflight could not write a checkpoint to ")
    assert "a-file/checkpoints/blocked/_preflight" in info.failure.message


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"strategy": "ddp", "tp": 2}, {"strategy": "fsdp", "tp": 1}], ids=["tp", "fsdp"])
def test_a_sharded_run_rehearses_its_checkpoint_in_shards_from_every_rank(make_spec, backend, tmp_path, decoder,
                                                                            layout):
    """Layers split over two cores (tp 2), or sharded over them (fsdp): each rank stores its shard, as
    training will, and reads its part back; a location that cannot take them fails every rank at once."""
    def spec(**train):
        return make_spec(2, model={"recipe": "hf-causal-lm", "params": {"pretrained": str(decoder), "seq_len": 32,
                                                                         "rows": "text"}},
                         gate={"metric": "perplexity", "metrics": []}, train={"parallelism": layout, **train})

    info = _sanity(backend, spec(), f"trip-{layout['strategy']}")
    assert info.state is JobState.SUCCEEDED, info.failure
    trip = info.result.checkpoint
    assert trip.passed and (trip.layout, trip.ranks) == ("sharded", 2) and trip.bytes > 0
    run = tmp_path / "checkpoints" / f"trip-{layout['strategy']}"
    assert not any(p.is_file() for p in run.rglob("*")), sorted(run.rglob("*"))

    (tmp_path / "a-file").write_text("not a folder")
    blocked = _sanity(backend, spec(checkpoint_url=str(tmp_path / "a-file" / "checkpoints")), "blocked")
    assert blocked.state is JobState.FAILED and blocked.failure.type == "FatalError", blocked.failure
    assert "could not write a checkpoint to " in blocked.failure.message
    assert "a-file/checkpoints/blocked/_preflight" in blocked.failure.message
