"""Checkpoints written in the background: the staged copy is the state as it was, one write is in
flight at a time, a write's failure reaches the training loop, and a write whose meta comes later
commits only once it is given."""

import threading
from concurrent.futures import CancelledError

import pytest
import torch

from tests.factories import checkpoint_meta
from trnflow.records import MetricPoint
from trnflow.workload.checkpoint import RunCheckpoints, load
from trnflow.workload.checkpointing import MetaLater
from trnflow.workload.saver import BackgroundSaver, stage


def test_the_staged_copy_keeps_the_state_as_it_was_at_the_step():
    weight = torch.arange(4.0)
    optim = {"state": {0: {"exp_avg": torch.ones(2), "step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}
    staged = stage({"model": {"w": weight}, "optim": optim})
    weight.add_(100)  # the training that goes on changes its tensors in place
    optim["state"][0]["exp_avg"].mul_(0)
    optim["param_groups"][0]["lr"] = 0.5
    assert torch.equal(staged["model"]["w"], torch.arange(4.0))
    assert torch.equal(staged["optim"]["state"][0]["exp_avg"], torch.ones(2))
    assert staged["optim"]["param_groups"][0]["lr"] == 0.1


def test_a_write_goes_on_while_the_loop_does_and_its_url_comes_back_once_it_ends():
    saver, release = BackgroundSaver(), threading.Event()

    def write() -> str:
        release.wait(10)
        return "file:///ckpt/step-000004"

    saver.submit(4, write, stalled=0.01)
    assert saver.step == 4 and saver.finished() is None  # still writing: the loop is not held
    with pytest.raises(AssertionError, match="one checkpoint write in flight"):
        saver.submit(8, write, stalled=0.0)
    release.set()
    saved = saver.wait()
    assert saved is not None and (saved.step, saved.url, saved.stalled) == (4, "file:///ckpt/step-000004", 0.01)
    assert saved.wrote >= 0 and saver.step is None and saver.wait() is None


def test_a_failed_write_is_raised_in_the_loop():
    saver = BackgroundSaver()

    def write() -> str:
        raise OSError("No space left on device")

    saver.submit(4, write, stalled=0.0)
    with pytest.raises(OSError, match="No space left"):
        saver.wait()
    assert saver.step is None and saver.finished() is None


def _files_then_commit(run: RunCheckpoints, step: int, later: MetaLater, written: threading.Event):
    weights = {"w": torch.arange(4.0)}

    def write() -> str:  # as the last checkpoint's write does: files, then the meta once given, then the marker
        listed = run.write_files(step, weights, {"state": {}, "param_groups": []}, [{}], ("tok.json", b"{}"))
        written.set()
        return run.commit(step, listed, later.take)

    return write


def test_a_write_whose_meta_comes_later_commits_once_it_is_given_and_not_at_all_when_abandoned(tmp_path):
    run, saver, written = RunCheckpoints(str(tmp_path / "run")), BackgroundSaver(), threading.Event()
    evaluated = []  # what the meta is made from when it is given: the evaluation done meanwhile
    later = MetaLater(lambda: checkpoint_meta(step=12, evaluations=list(evaluated)))
    saver.submit(12, _files_then_commit(run, 12, later, written), stalled=0.0)
    assert written.wait(10)
    assert saver.finished() is None and run.committed() == []  # its files are written: it waits for its meta
    evaluated.append(MetricPoint(step=12, global_step=12, values={"loss": 0.5}))
    later.ready()
    saved = saver.wait(10)
    assert saved is not None and run.committed() == [12]
    meta = load(saved.url).meta
    assert meta is not None and [p.step for p in meta.evaluations] == [12]

    written.clear()
    abandoned = MetaLater(lambda: checkpoint_meta(step=16))
    saver.submit(16, _files_then_commit(run, 16, abandoned, written), stalled=0.0)
    assert written.wait(10)
    abandoned.abandon()  # the evaluation failed: the write ends, committing nothing
    with pytest.raises(CancelledError):
        saver.wait(10)
    assert run.committed() == [12] and not (tmp_path / "run" / "step-000016").exists()
