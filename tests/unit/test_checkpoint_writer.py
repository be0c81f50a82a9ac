"""A whole checkpoint written by the writer process: the same files as one saved in this process,
paced or not, the state as it was when staged, the memory reused, and every way it fails said in the
loop; a paced write spread over its seconds until hurried."""

import os
import signal

import pytest
import torch

from tests.conftest import tiny_m5
from tests.factories import checkpoint_meta
from trnflow.workload import writer as writing
from trnflow.workload.checkpoint import MARKER, RunCheckpoints, load, step_name, trained_state
from trnflow.workload.programs import build_model
from trnflow.workload.saver import stage
from trnflow.workload.writer import PROCESS_BYTES, CheckpointWriter, Pace, Request, WriteFailed, in_process

FEATURIZER = ("tokenizer.json", b'{"model": "tiny"}')


def _state(seed: int = 0) -> tuple[dict, dict]:
    model = build_model(tiny_m5(), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    sum(p.pow(2).sum() for p in model.parameters()).backward()
    optimizer.step()
    return trained_state(model), optimizer.state_dict()


RNG = [{"torch": torch.get_rng_state(), "sr": torch.Generator().get_state()}]


def _request(run: str, step: int, model, optim, keep_latest=None, seconds=None) -> Request:
    return Request(run, step, model, optim, RNG, FEATURIZER, checkpoint_meta(step=step), keep_latest, seconds)


@pytest.fixture
def writer():
    writer = CheckpointWriter()
    yield writer
    writer.close()


def test_the_writer_saves_the_files_this_process_would_paced_and_the_state_as_it_was_staged(tmp_path, writer):
    model, optim = _state()
    ours = RunCheckpoints(str(tmp_path / "ours"))
    ours.save(4, *stage([model, optim]), RNG, FEATURIZER, checkpoint_meta(step=4))  # as the thread writes it

    laid = writer.stage(model, optim)
    before = {name: t.clone() for name, t in model.items()}
    for t in model.values():  # the training that goes on changes its tensors in place
        t.add_(1)
    writer.hurry()  # paced over a day, the loop waiting for it: written at once
    url = writer.save(_request(str(tmp_path / "theirs"), 4, *laid, seconds=86400.0))

    assert url == f"{tmp_path / 'theirs'}/{step_name(4)}" and (tmp_path / "theirs" / step_name(4) / MARKER).exists()
    ours_nice = os.getpriority(os.PRIO_PROCESS, 0)  # the writer yields its CPU to the host's other work
    assert os.getpriority(os.PRIO_PROCESS, writer._process.pid) == min(19, ours_nice + writing.NICENESS)
    for name in ("model.pt", "optim.pt"):  # byte for byte: one storage for each tensor, as the thread writes
        theirs = (tmp_path / "theirs" / step_name(4) / name).read_bytes()
        assert theirs == (tmp_path / "ours" / step_name(4) / name).read_bytes(), name
    saved = load(url)
    assert all(torch.equal(saved.model[name], before[name]) for name in before)
    assert torch.equal(saved.optim["state"][0]["exp_avg"], optim["state"][0]["exp_avg"])


def test_asked_for_its_files_only_the_writer_leaves_the_commit_to_the_loop_with_the_meta_known_later(tmp_path, writer):
    """The run's last checkpoint is written beside its evaluation: the writer writes its files, the
    loop commits them once the meta (holding that evaluation) is known; loaded, it is a whole one."""
    model, optim = _state()
    run = RunCheckpoints(str(tmp_path / "run"))
    files = writer.write_files(Request(run.url, 8, *writer.stage(model, optim), RNG, FEATURIZER, None, None))
    assert sorted(files) == ["model.pt", "optim.pt", "state.pt", "tokenizer.json"]
    assert run.committed() == [] and not (tmp_path / "run" / step_name(8) / "meta.json").exists()

    url = run.commit(8, files, checkpoint_meta(step=8, loss=0.25))
    assert run.committed() == [8] and url == f"{run.url}/{step_name(8)}"
    saved = load(url)
    assert saved.meta is not None and saved.meta.loss == 0.25
    assert all(torch.equal(saved.model[name], t) for name, t in model.items())


@pytest.mark.slow  # two writer processes start, a few seconds each
def test_the_process_and_its_memory_serve_every_checkpoint_until_the_state_changes_shape(tmp_path, writer):
    run = RunCheckpoints(str(tmp_path / "run"))
    model, optim = _state()
    writer.prepare(model, optim)  # as after an attempt's first step: the process starts, nothing is copied
    first = writer._process
    assert first is not None and first.poll() is None
    for step in (4, 8, 12):
        for t in model.values():
            t.add_(step)
        optim["param_groups"][0]["lr"] = 0.1 / step  # a schedule moves it: the same memory serves
        writer.save(_request(run.url, step, *writer.stage(model, optim), keep_latest=2))
        assert load(f"{run.url}/{step_name(step)}").optim["param_groups"][0]["lr"] == 0.1 / step
        saved = load(f"{run.url}/{step_name(step)}").model
        assert all(torch.equal(saved[name], t) for name, t in model.items())
    assert writer._process is first and run.committed() == [8, 12]  # pruned by the writer, as a save prunes

    wider, optim = _state()
    wider["extra"] = torch.ones(3)
    writer.save(_request(run.url, 16, *writer.stage(wider, optim)))
    assert writer._process is not first and first.poll() == 0  # the old one ended once its pipe closed
    assert torch.equal(load(f"{run.url}/{step_name(16)}").model["extra"], torch.ones(3))


@pytest.mark.slow  # two writer processes start, a few seconds each
def test_a_failed_write_and_a_lost_writer_are_raised_in_the_loop_and_leave_no_marker(tmp_path, writer):
    model, optim = _state()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(WriteFailed, match=r"writing the checkpoint of step 4: \w+Error") as failed:
        writer.save(_request(str(tmp_path / "file" / "run"), 4, *writer.stage(model, optim)))
    assert failed.value.retryable is None  # as the store's own error was

    laid = writer.stage(model, optim)  # the same process answers the next one
    os.kill(writer._process.pid, signal.SIGKILL)  # as the kernel's OOM killer would end it
    with pytest.raises(WriteFailed, match=r"writer process ended \(exit code -9\) before step 8") as lost:
        writer.save(_request(str(tmp_path / "run"), 8, *laid))
    assert lost.value.retryable is True and not (tmp_path / "run" / step_name(8) / MARKER).exists()

    writer.save(_request(str(tmp_path / "run"), 12, *writer.stage(model, optim)))  # a new process takes over
    assert RunCheckpoints(str(tmp_path / "run")).committed() == [12]


def test_auto_writes_a_large_state_in_the_process_and_a_small_one_on_the_thread():
    small = {"w": torch.zeros(16)}
    large = {"w": torch.zeros(PROCESS_BYTES // 4)}
    assert not in_process("auto", small, {}) and in_process("auto", large, {"state": {}})
    assert in_process("process", small, {}) and not in_process("thread", large, {})


def test_a_paced_write_keeps_to_its_schedule_until_hurried(monkeypatch):
    """100 MB over 10 s: after each part, it waits until that part's share of the 10 s has passed;
    hurried, it waits no more (a clock of the test's own: nothing here is timed)."""
    clock = {"now": 0.0, "slept": 0.0}

    def sleep(seconds):
        clock["now"] += seconds
        clock["slept"] += seconds

    monkeypatch.setattr(writing.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(writing.time, "sleep", sleep)
    hurried = []
    pace = Pace(100_000_000, 10.0, lambda: bool(hurried))
    clock["now"] += 0.2  # the first 8 MB took 0.2 s to write: due at 0.8 s
    pace(8_000_000)
    assert clock["now"] == pytest.approx(0.8)
    clock["now"] += 2.0  # a slow part: behind schedule, no wait
    pace(8_000_000)
    assert clock["now"] == pytest.approx(2.8) and clock["slept"] == pytest.approx(0.6)
    hurried.append(True)
    pace(80_000_000)  # ahead by 6.8 s, but hurried
    assert clock["now"] == pytest.approx(2.8)
