"""Exclusive NeuronCore ownership: one process per core, released when the holder dies."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.emulator.cores import CoresUnavailable, acquire, allocate, holder, holders
from trnflow.errors import FatalError, TransientError
from trnflow.settings import TrnflowSettings

HOLD = """
import sys, time
from trnflow.emulator.cores import acquire
lease = acquire([int(c) for c in sys.argv[1].split(",")], 32, command="test holder")
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def held_by_other_process():
    procs = []

    def hold(cores: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", HOLD, cores], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_held_core_is_refused_at_once_naming_the_holder(held_by_other_process):
    proc = held_by_other_process("4,5")
    with pytest.raises(CoresUnavailable) as info:
        acquire([4, 5], 32, command="second job")
    message = str(info.value)
    assert "NeuronCore(s) not available - Requested:nc4-nc5 Available:30" in message
    assert f"pid {proc.pid}" in message and "test holder" in message
    assert holder(4)["pid"] == proc.pid


def test_cores_are_released_when_the_holder_is_killed(held_by_other_process):
    proc = held_by_other_process("6")
    assert 6 in holders(32)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lease = acquire([6], 32, command="after the kill")
    assert holder(6)["command"] == "after the kill"
    lease.release()
    assert holder(6) is None


def test_allocation_skips_held_and_excluded_cores_and_keeps_alignment(held_by_other_process):
    held_by_other_process("0")
    assert allocate(2, 32) == [2, 3]  # 0-1 is taken; ranges start at a multiple of their size
    assert allocate(2, 32, frozenset({2})) == [4, 5]
    assert allocate(8, 32) == [8, 9, 10, 11, 12, 13, 14, 15]
    with pytest.raises(FatalError, match="only 1 healthy NeuronCore"):
        allocate(2, 2, frozenset({1}))


def test_a_job_on_held_cores_waits_for_them_naming_the_run_that_holds_them(make_spec, trnflow_home, caplog):
    """Cores another run holds are waited for up to compute.max_pending_minutes, as a cloud job waits
    for capacity; with no time to wait, the job fails as transient, naming the holders and their run."""
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    spec = make_spec(name="owner", train={"steps": 100_000, "checkpoint_every": 100_000})
    first = backend.submit(JobRequest(spec, "train", "long", cores=(0, 1)))
    deadline = time.monotonic() + 120
    while '"event": "data"' not in backend.logs(first)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    owners = {core: h["pid"] for core, h in holders(2).items()}
    assert set(owners) == {0, 1}

    impatient = make_spec(name="second", compute={"max_pending_minutes": 0.001})
    with pytest.raises(TransientError) as refused:
        backend.submit(JobRequest(impatient, "sanity", "s", cores=(0, 1)))
    message = str(refused.value)
    assert message.startswith("sanity: the NeuronCores it needs are busy after waiting 0.001 min "
                              "(compute.max_pending_minutes): nc0 held by pid ")
    assert all(f"pid {pid} (trnflow.workload train rank {rank} of run long)" in message
               for rank, pid in enumerate(owners.values()))

    submitted: list[str] = []
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trnflow.backends"):
        waiting = threading.Thread(target=lambda: submitted.append(backend.submit(
            JobRequest(make_spec(name="third", compute={"max_pending_minutes": 5}), "sanity", "w", cores=(0, 1)))))
        waiting.start()
        while not caplog.records and time.monotonic() < deadline + 60:
            time.sleep(0.1)
        assert not submitted  # still waiting for the cores
        (told,) = [r.getMessage() for r in caplog.records]
        assert told.startswith("sanity of run w waits up to 5 min for its NeuronCores: nc0 held by pid ")
        assert "of run long" in told
        for pid in owners.values():  # SIGKILL the holders: no cleanup code runs
            os.kill(pid, signal.SIGKILL)
        backend.cancel(first)
        waiting.join(120)
    third = wait(backend, submitted[0], 0.2)
    assert third.state is JobState.SUCCEEDED, third.failure


def test_devices_shows_who_holds_each_core(held_by_other_process):
    from typer.testing import CliRunner

    from trnflow.cli.app import app

    proc = held_by_other_process("3")
    records = json.loads(CliRunner().invoke(app, ["devices", "--instance-type", "trn1.32xlarge", "--json"]).stdout)
    procs = records[1]["neuron_processes"]
    assert procs == [{"pid": proc.pid, "command": "test holder", "neuroncore_ids": [3]}]
    assert records[0]["neuron_processes"] == []


def test_top_shows_owner_utilisation_and_memory_per_core(held_by_other_process):
    from typer.testing import CliRunner

    from trnflow.cli.app import app

    proc = held_by_other_process("1")
    result = CliRunner().invoke(app, ["top", "--instance-type", "trn1.2xlarge", "--json", "--interval", "0.2"])
    rows = {r["core"]: r for r in json.loads(result.stdout)}
    assert rows[1]["pid"] == proc.pid and rows[1]["command"] == "test holder"
    assert rows[1]["memory_bytes"] > 0 and 0 <= rows[1]["utilization"] <= 100
    assert rows[0]["pid"] is None
    snapshot = CliRunner().invoke(app, ["top", "--once", "--interval", "0.1"])
    assert "nc1" in snapshot.stdout and "test holder" in snapshot.stdout


def test_the_runtime_core_variables_are_honoured(make_spec, trnflow_home, monkeypatch):
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "6-7")
    info = wait(backend, backend.submit(JobRequest(make_spec(compute={"instance_type": "trn1.32xlarge"}),
                                                   "sanity", "v")), 0.2)
    assert info.state is JobState.SUCCEEDED and [c.core for c in info.result.per_core] == [6, 7]
    monkeypatch.delenv("NEURON_RT_VISIBLE_CORES")
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "1")
    with pytest.raises(FatalError, match="NEURON_RT_NUM_CORES=1"):
        backend.submit(JobRequest(make_spec(), "sanity", "n"))
