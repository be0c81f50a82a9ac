"""Training end to end on the emulator: exact resume after faults, resharding, incremental runs."""

import json
import shutil

import pytest
import torch

from tests.factories import commit
from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.lifecycle.digests import registered_digests
from trnflow.lifecycle.registry import Registry
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec
from trnflow.storage import local_path
from trnflow.workload.checkpoint import load
from trnflow.workload.features import IN_MEMORY_ENV
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for
from trnflow.workload.synth import synthesize

SHORT = {"steps": 12, "checkpoint_every": 4, "log_every": 4}
BIG = {"instance_type": "trn1.32xlarge", "cores_per_node": 2}  # spare cores to move to


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _train(backend, spec: JobSpec, run_id: str):
    job_id = backend.submit(JobRequest(spec, "train", run_id))
    return wait(backend, job_id, 0.2), job_id


def _weights(result) -> dict:
    return load(result.checkpoint).model


@pytest.mark.slow
def test_a_checkpoint_saved_by_4_ranks_resumes_on_2(make_spec, backend, monkeypatch):
    monkeypatch.setenv(IN_MEMORY_ENV, "0")  # the featurized rows go to local disk, as a large training set's do
    four = make_spec(compute={"instance_type": "trn1.32xlarge", "cores_per_node": 4},
                     train={"steps": 4, "checkpoint_every": 2}, faults=[{"kind": "timeout", "core": 3, "step": 3}])
    failed, _ = _train(backend, four, "reshard")
    assert failed.state is JobState.FAILED and failed.failure.type == "ExecutionTimeout"
    assert failed.failure.retryable is True

    two = make_spec(compute=BIG, train={"steps": 4, "checkpoint_every": 2})
    info, job_id = _train(backend, two, "reshard")
    assert info.state is JobState.SUCCEEDED, info.failure
    assert info.result.start_step == 2 and info.result.steps_trained == 2
    assert '"saved_by_ranks": 4' in backend.logs(job_id)[0] and '"ranks": 2' in backend.logs(job_id)[0]
    meta = load(info.result.checkpoint).meta
    assert meta.world_size == 2 and meta.sampler["step"] == 4
    memory = info.result.host_memory
    assert memory.features_spilled_to_disk is True and len(memory.peak_rss_mb_per_rank) == 2


@pytest.fixture
def daily(tmp_path):
    """Three days of reviews; the third is held back until the test publishes it."""
    full = tmp_path / "full"
    synthesize(full, days=3, rows_per_day=200, seed=11, holdout_rows=100, inference_rows=50)
    live = tmp_path / "live"
    shutil.copytree(full, live)
    shutil.rmtree(live / "train" / "dt=2026-01-03")
    return full, live


@pytest.mark.slow
def test_incremental_training_reads_only_new_partitions_and_skips_when_there_are_none(make_spec, backend, daily):
    full, live = daily
    data = {"train": str(live / "train"), "holdout": str(live / "holdout"), "inference": str(live / "inference"),
            "window": "since-watermark"}
    first, _ = _train(backend, make_spec(cores=1, data=data, train={"steps": 6, "checkpoint_every": 6}), "day-2")
    assert first.state is JobState.SUCCEEDED, first.failure
    assert first.result.partitions == ["2026-01-01", "2026-01-02"] and first.result.watermark == "2026-01-02"

    shutil.copytree(full / "train" / "dt=2026-01-03", live / "train" / "dt=2026-01-03")  # a new day lands
    registry = Registry(make_spec().registry_url)  # the first run is the champion the next one starts from
    digests = registered_digests(first.result.checkpoint, None)  # as a run's registration records them
    registry.promote("quickstart", registry.register("quickstart", {"checkpoint": first.result.checkpoint,
                                                                    "digests": digests}).version)
    follow = dict(data=data, train={"steps": 4, "checkpoint_every": 4, "init_from": "champion"})
    second, job_id = _train(backend, make_spec(cores=1, **follow), "day-3")
    assert second.state is JobState.SUCCEEDED, second.failure
    assert '"event": "champion", "rank": 0, "version": 1' in backend.logs(job_id)[0]
    result = second.result
    assert result.partitions == ["2026-01-03"] and result.rows == 200 and result.watermark == "2026-01-03"
    assert result.parent == first.result.checkpoint and result.global_step == 10
    child, parent = load(result.checkpoint), load(first.result.checkpoint)
    assert child.featurizer == parent.featurizer  # token ids never shift between incremental runs
    assert child.meta.lineage == [first.result.checkpoint]

    # Another job swaps the champion's weights and rewrites COMMITTED to match: every file matches
    # its marker, and the marker is not the one registered, so neither inference nor a run from the
    # champion loads it, and both say which version and which file.
    folder = local_path(first.result.checkpoint)
    (folder / "model.pt").write_bytes((local_path(result.checkpoint) / "model.pt").read_bytes())
    commit(folder)
    spec = make_spec(cores=1, **follow)
    inferred = wait(backend, backend.submit(JobRequest(spec, "infer", "swapped", checkpoint=first.result.checkpoint)),
                    0.2)
    assert inferred.state is JobState.FAILED and inferred.failure.retryable is False
    assert "quickstart v1:" in inferred.failure.message
    assert "COMMITTED lists other files than when the checkpoint was registered" in inferred.failure.message
    retrained, _ = _train(backend, spec, "from-a-swapped-champion")
    assert retrained.state is JobState.FAILED and "quickstart v1:" in retrained.failure.message

    again = dict(data=data, train={"steps": 4, "checkpoint_every": 4, "init_from": result.checkpoint})
    nothing, _ = _train(backend, make_spec(cores=1, **again), "day-3-again")
    assert nothing.state is JobState.SUCCEEDED
    assert nothing.result.skipped is True and "after the watermark 2026-01-03" in nothing.result.reason
    assert not local_path(make_spec(cores=1, **again).train.checkpoint_url).joinpath("day-3-again").exists()


def test_a_plain_state_dict_from_another_program_is_a_starting_point(make_spec, backend, tmp_path):
    spec = make_spec(cores=1, train={"steps": 2, "checkpoint_every": 2, "init_from": str(tmp_path / "gpu-weights.pt")})
    gpu_run = build_model(recipe_for(spec), seed=99)  # as a GPU job that knows nothing of trnflow would save it
    torch.save(gpu_run.state_dict(), tmp_path / "gpu-weights.pt")
    info, job_id = _train(backend, spec, "from-gpu")
    assert info.state is JobState.SUCCEEDED, info.failure
    assert info.result.parent == (tmp_path / "gpu-weights.pt").as_uri()
    logs = backend.logs(job_id)[0]
    assert '"event": "init"' in logs and "no tokenizer.json beside it" in logs
    # two AdamW steps move each weight by a few lr at most: the run started from these weights
    trained, scratch = _weights(info.result), build_model(recipe_for(spec), seed=spec.train.seed).state_dict()
    step = 4 * spec.train.lr
    assert all((trained[k] - v).abs().max() <= step for k, v in gpu_run.state_dict().items())
    assert any((trained[k] - v).abs().max() > 10 * step for k, v in scratch.items())


def test_a_non_finite_loss_stops_the_run_with_a_clear_error_that_is_never_retried(make_spec, backend):
    spec = make_spec(train={"steps": 4, "checkpoint_every": 4}, faults=[{"kind": "nan", "core": 1, "step": 2}])
    info, _ = _train(backend, spec, "diverged")
    assert info.state is JobState.FAILED
    assert info.failure.type == "FatalError" and info.failure.retryable is False
    assert "loss is nan at step 2 on rank 1" in info.failure.message and "Lower train.lr" in info.failure.message


def _launcher_pid(backend, job_id: str) -> int:
    """The job's launcher (torchrun's agent): the supervisor's child."""
    import json
    from pathlib import Path

    supervisor = json.loads((backend.jobs_dir / job_id / "pid.json").read_text())["pid"]
    (child,) = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    return int(child)


def test_a_spot_reclaim_notice_checkpoints_at_the_next_step_and_the_retry_ends_with_the_same_weights(
        make_spec, backend):
    """SIGTERM reaches the ranks mid-training (as SageMaker's spot reclaim notice reaches the
    container, which passes it on): they agree on a step, checkpoint it and end as transient. The
    rerun resumes from that step and ends with the weights of a run that was never interrupted."""
    import os
    import signal
    import time

    spec = make_spec(name="spot", compute={"spot": True}, train={"steps": 30, "checkpoint_every": 100,
                                                                  "log_every": 1})
    job_id = backend.submit(JobRequest(spec, "train", "reclaimed"))
    deadline = time.monotonic() + 300
    while '"step": 5,' not in backend.logs(job_id)[0]:
        assert time.monotonic() < deadline and backend.describe(job_id).state is JobState.RUNNING, \
            backend.logs(job_id)[0][-3000:]
        time.sleep(0.1)
    os.kill(_launcher_pid(backend, job_id), signal.SIGTERM)
    info = wait(backend, job_id, 0.2)
    assert info.state is JobState.FAILED
    failure = info.failure
    assert failure.type == "SpotInterruption" and failure.retryable is True, failure
    stopped = int(failure.message.split("training stopped after step ")[1].split()[0])
    assert 5 <= stopped < 30
    assert (local_path(spec.train.checkpoint_url) / "reclaimed" / f"step-{stopped:06d}").is_dir()

    resumed, _ = _train(backend, spec, "reclaimed")
    assert resumed.state is JobState.SUCCEEDED, resumed.failure
    assert resumed.result.start_step == stopped
    whole, _ = _train(backend, spec, "never-reclaimed")
    assert whole.state is JobState.SUCCEEDED, whole.failure
    ours, theirs = _weights(resumed.result), _weights(whole.result)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _same(a, b) -> bool:
    """Equal to the bit: tensors, and every nest of dicts and lists of them."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoints_written_in_the_background_equal_those_written_in_step_and_a_torn_one_resumes_bitwise(
        make_spec, backend, strategy):
    """The same 12 steps on two ranks, checkpointed every 4 steps in the background (the default: rank 0's
    writer process writes a whole checkpoint, each rank its shard of a sharded one on a thread; the last
    one's files while the holdout evaluates its weights, its meta and marker after) and before training
    goes on (`checkpoint_async: false`), the latter recomputing its blocks' activations (full under ddp,
    selective under fsdp): each checkpoint holds the same weights, optimizer state and random states,
    dropout's replayed. Under ddp, a run (recomputing selectively) whose rank 0 is killed halfway
    through writing the step-8 checkpoint in the background leaves it uncommitted; the retry resumes
    from step 4 and ends with the same weights. (A sharded write torn so is a fault matrix case,
    fsdp-torn-checkpoint.)"""
    train = {"steps": 12, "checkpoint_every": 4, "log_every": 4, "keep_latest": None,
             "parallelism": {"strategy": strategy}}
    background, job_id = _train(backend, make_spec(train={**train, "checkpoint_writer": "process"}), "background")
    assert background.state is JobState.SUCCEEDED, background.failure
    said = [json.loads(line) for line in backend.logs(job_id)[0].splitlines() if '"event": "checkpoint"' in line]
    assert [e["step"] for e in said] == [4, 8, 12] and all(e["stalled_s"] >= 0 and e["wrote_s"] > 0 for e in said)
    assert all(e["slowed_s"] >= 0 for e in said) and said[-1]["slowed_s"] == 0  # the last, beside the evaluation
    assert [e["writer"] for e in said] == ["process" if strategy == "ddp" else "thread"] * 3
    recomputed = "full" if strategy == "ddp" else "selective"
    in_step, _ = _train(backend, make_spec(train={**train, "checkpoint_async": False,
                                                  "activation_checkpointing": recomputed}), "in-step")
    assert in_step.state is JobState.SUCCEEDED, in_step.failure
    for step in (4, 8, 12):
        ours = load(background.result.checkpoint.replace("step-000012", f"step-{step:06d}"))
        theirs = load(in_step.result.checkpoint.replace("step-000012", f"step-{step:06d}"))
        assert ours.sharded == theirs.sharded == (strategy == "fsdp")
        assert _same(ours.model, theirs.model) and _same(ours.optim, theirs.optim) and _same(ours.rng, theirs.rng)
    # the last one, its files written while the holdout evaluated its weights, holds that evaluation
    assert ours.meta is not None and theirs.meta is not None and ours.meta.evaluations[-1].step == 12
    assert ours.meta.evaluations == theirs.meta.evaluations == background.result.evaluations
    if strategy != "ddp":
        return

    torn = make_spec(train={**train, "activation_checkpointing": "selective"},
                     faults=[{"kind": "torn", "core": 0, "step": 8, "phase": "train"}])
    failed, _ = _train(backend, torn, "torn")
    assert failed.state is JobState.FAILED and failed.failure.retryable is True, failed.failure
    folder = local_path(torn.train.checkpoint_url) / "torn"
    assert (folder / "step-000008").is_dir() and not (folder / "step-000008" / "COMMITTED").exists()
    resumed, _ = _train(backend, torn, "torn")
    assert resumed.state is JobState.SUCCEEDED, resumed.failure
    assert resumed.result.start_step == 4
    assert _same(_weights(resumed.result), _weights(in_step.result))


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "spike"), [("ddp", 10), ("fsdp", 9)])
def test_a_loss_spike_rolled_back_skips_its_batch_and_ends_as_a_run_told_to_skip_it_from_the_start(
        make_spec, backend, strategy, spike):
    """Two ranks, 12 steps, a checkpoint every 4 written in the background: rank 1's loss spikes a
    thousandfold at step `spike`. With `on_divergence: rollback`, every rank goes back to step 8's
    checkpoint (under fsdp, the step after it: its shards may still be in flight), replays the steps
    between and skips the spiked step's batch, recorded with its samples and why in the result and
    in rollbacks.json beside the checkpoints. Its final weights, optimizer state and loss equal, bit
    for bit, those of a run told from the start to skip that step (`skip_steps`), which saw no spike."""
    train = {"steps": 12, "checkpoint_every": 4, "log_every": 2, "parallelism": {"strategy": strategy}}
    spiked = make_spec(train={**train, "on_divergence": "rollback"},
                       faults=[{"kind": "spike", "core": 1, "step": spike, "phase": "train"}])
    healed, job_id = _train(backend, spiked, "spiked")
    assert healed.state is JobState.SUCCEEDED, healed.failure
    [rollback] = healed.result.rollbacks
    assert (rollback.step, rollback.restored_from) == (spike, 8)
    assert rollback.reason.startswith("loss ") and "on rank 1, over 5 x the median" in rollback.reason
    assert len(rollback.samples) == spiked.train.global_batch_size  # every replica's rows of the step's batch
    kept = json.loads((local_path(spiked.train.checkpoint_url) / "spiked" / "rollbacks.json").read_text())
    assert kept["rollbacks"][0]["samples"] == rollback.samples
    events = [json.loads(line)["event"] for line in backend.logs(job_id)[0].splitlines() if line.startswith("{")]
    assert events.count("rollback") == 1 and events.count("skip") >= 1
    skipped, _ = _train(backend, make_spec(train={**train, "skip_steps": [spike]}), "skipped")
    assert skipped.state is JobState.SUCCEEDED, skipped.failure
    assert skipped.result.rollbacks == []
    ours, theirs = load(healed.result.checkpoint), load(skipped.result.checkpoint)
    assert _same(ours.model, theirs.model) and _same(ours.optim, theirs.optim)
    assert ours.meta.loss == theirs.meta.loss and healed.result.loss == skipped.result.loss
    assert healed.result.time.rollback_seconds > 0 and skipped.result.time.rollback_seconds == 0
    plain, _ = _train(backend, make_spec(train=train), "plain")  # skipping a batch changed something
    assert not _same(load(plain.result.checkpoint).model, ours.model)
