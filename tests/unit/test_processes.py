"""Whether a process named by a lock or job record still runs: one answer, in `trnflow.processes`,
for the compile cache's entry locks, the retraining lock, the local backend's jobs and the
emulator's per-rank folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from trnflow.processes import pid_alive

pytestmark = pytest.mark.unit


def test_this_process_is_alive_and_an_ended_one_is_not():
    assert pid_alive(os.getpid())
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert not pid_alive(ended.pid)


def test_a_pid_that_names_no_single_process_is_not_alive():
    # 0 and -1 would ask about this process group, or every process: a record holding one names nobody
    assert [pid_alive(pid) for pid in (0, -1, -7)] == [False, False, False]


def test_another_users_process_counts_unless_the_callers_own_is_meant(monkeypatch):
    def denied(pid, sig):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", denied)
    assert pid_alive(4242) is True  # a shared cache's lock held by another user's compile
    assert pid_alive(4242, ours=True) is False  # a job's supervisor is ours: another's at that pid is not it


def test_a_reused_pid_counts_as_alive(monkeypatch):
    """The known limit of a pid: a new process given the number of one that ended counts as alive
    (the record's host, and on another host its age, are what the callers add)."""
    monkeypatch.setattr(os, "kill", lambda pid, sig: None)  # someone now runs under the recorded pid
    assert pid_alive(4242) and pid_alive(4242, ours=True)


def test_every_record_that_names_a_process_asks_the_one_function():
    import inspect

    from trnflow.backends import local
    from trnflow.device import cache_lock
    from trnflow.emulator import device

    for module in (cache_lock, local, device):
        assert module.pid_alive is pid_alive
        assert "os.kill(" not in inspect.getsource(module)
    lock = (Path(__file__).resolve().parents[2] / "flows" / "_lock.py").read_text()  # imports Prefect: read, not run
    assert "from trnflow.processes import pid_alive" in lock and "os.kill(" not in lock
