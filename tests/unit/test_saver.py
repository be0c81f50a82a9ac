"""Checkpoints written in the background: the staged copy is the state as it was, one write is in
flight at a time, and a write's failure reaches the training loop."""

import threading

import pytest
import torch

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
