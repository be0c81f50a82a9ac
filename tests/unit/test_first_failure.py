"""A multi-rank job's failure names the rank that failed first, not every rank torchrun stopped after
it: from the ranks' own reports, torchrun's record of how each ended, and the rank's own log."""

import importlib
import json
import os
import signal
from types import SimpleNamespace

import pytest

from trnflow.backends.failures import RankExit, name_first_rank, read_exits, root_failure
from trnflow.backends.launcher import EXITS, exits_record, keep_every_exit
from trnflow.results import FailureReport


def test_of_two_ranks_that_report_their_own_errors_the_first_to_report_is_the_cause():
    late = FailureReport(rank=0, type="ExecutionTimeout", retryable=True, message="nc0", reported_at=20.0)
    early = FailureReport(rank=1, type="HardwareError", retryable=True, message="nc1", reported_at=10.0)
    assert root_failure([late, early], 2).rank == 1
    bug0 = FailureReport(rank=0, type="KeyError", retryable=None, message="'x'", reported_at=5.0)
    bug1 = bug0.model_copy(update={"rank": 1, "reported_at": 4.0})
    assert root_failure([bug0, bug1], 2).rank == 1


def test_a_silent_death_names_the_rank_that_died_not_the_ones_torchrun_stopped():
    peer = FailureReport(rank=0, type="RuntimeError", retryable=None, message="Connection reset by peer",
                         reported_at=100.5)
    killed = RankExit(1, -9, 100.0)
    assert root_failure([peer], 2, exits=[killed, RankExit(0, 1, 100.0)]).ranks == [1]
    stopped = RankExit(0, -15, 101.0)  # torchrun's SIGTERM, after rank 1 died: rank 0 said nothing
    failure = root_failure([], 2, exits=[stopped, killed])
    assert failure.ranks == [1] and "signal SIGKILL" in failure.message and "rank 0" not in failure.message
    assert root_failure([], 2).ranks == [0, 1]  # without torchrun's record, no rank can be told apart
    segv = RankExit(0, -11, 99.0)
    assert root_failure([], 2, exits=[killed, segv]).ranks == [0]  # the first to end, by when torchrun saw it


def test_the_failure_quotes_the_exit_and_the_last_lines_of_that_ranks_own_log(tmp_path):
    logs = tmp_path / "run_x" / "attempt_0" / "1"
    logs.mkdir(parents=True)
    (logs / "stdout.log").write_text("".join(f'{{"event": "train", "step": {i}}}\n' for i in range(1, 31)))
    (logs / "stderr.log").write_text("trnflow.workload train failed on rank 1: HardwareError: nc1\n")
    failure = FailureReport(rank=1, type="HardwareError", retryable=True, message="nc1")
    named = name_first_rank(failure, [RankExit(0, -15, 2.0, str(tmp_path / "run_x/attempt_0/0")),
                                      RankExit(1, 1, 1.0, str(logs))])
    assert (named.exitcode, named.signal) == (1, None)
    lines = named.message.splitlines()
    assert lines[:2] == ["nc1", f"rank 1 failed first (exit code 1); the last lines of its log ({logs}):"]
    assert lines[2].strip() == '{"event": "train", "step": 19}' and len(lines) == 2 + 12 + 1
    assert lines[-1].strip() == "trnflow.workload train failed on rank 1: HardwareError: nc1"
    both = FailureReport(type="WorkerLost", ranks=[0, 1], message="m")
    assert name_first_rank(both, [RankExit(1, 1, 1.0)]).message == "m"
    # ranks that wrote to their launcher's output (a container's) have no log to quote
    one = FailureReport(type="WorkerLost", ranks=[1], message="m")
    assert name_first_rank(one, [RankExit(1, -9, 1.0)]) == one.model_copy(update={"exitcode": -9, "signal": "SIGKILL"})


def test_torchruns_failures_are_recorded_with_each_ranks_log_folder(tmp_path):
    (tmp_path / "c0ffee_ab12" / "attempt_0" / "1").mkdir(parents=True)
    (tmp_path / "c0ffee_ab12" / "attempt_0" / "1" / "stderr.log").write_text("")
    (tmp_path / "c0ffee_ab12" / "attempt_0" / "0").mkdir()  # torchrun's folder, without logs (--console)
    failures = {1: SimpleNamespace(local_rank=1, pid=42, exitcode=-9, timestamp=1700000000),
                0: SimpleNamespace(local_rank=0, pid=41, exitcode=-15, timestamp=1700000001)}
    (tmp_path / EXITS).write_text(json.dumps(exits_record(tmp_path, failures)))
    assert read_exits(tmp_path) == [RankExit(0, -15, 1700000001.0, ""),
                                    RankExit(1, -9, 1700000000.0, str(tmp_path / "c0ffee_ab12/attempt_0/1"))]
    assert [(e.signal, e.stopped) for e in read_exits(tmp_path)] == [("SIGTERM", True), ("SIGKILL", False)]
    assert read_exits(tmp_path / "none") == []


def test_forked_ranks_torchrun_did_not_name_are_recorded_with_the_one_it_named(tmp_path):
    (tmp_path / "c0ffee_ab12" / "attempt_0" / "1").mkdir(parents=True)
    (tmp_path / "c0ffee_ab12" / "attempt_0" / "1" / "stdout.log").write_text("")
    named = {2: SimpleNamespace(local_rank=0, pid=41, exitcode=1, timestamp=1700000000)}  # node 1 of 2-rank nodes
    ended = {0: (41, 1, 1700000000.5), 1: (42, -9, 1700000000.5)}
    (tmp_path / EXITS).write_text(json.dumps(exits_record(tmp_path, named, ended)))
    assert read_exits(tmp_path) == [RankExit(2, 1, 1700000000.0, ""),
                                    RankExit(3, -9, 1700000000.5, str(tmp_path / "c0ffee_ab12/attempt_0/1"))]
    assert exits_record(tmp_path, named, {1: (42, 0, 1.0)})["ranks"] == exits_record(tmp_path, named)["ranks"]


def _end(code: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL) if code < 0 else os._exit(code)


def test_the_launcher_keeps_how_every_forked_rank_ended_when_one_fails(monkeypatch):
    """Two forked processes end before the launcher looks (one exits 1, the other is SIGKILLed):
    torch names one of them; `keep_every_exit` has both."""
    spawn = importlib.import_module("torch.multiprocessing.spawn")  # the module, not the function
    monkeypatch.setattr(spawn, "ProcessContext", spawn.ProcessContext)  # put back after the test
    ended = keep_every_exit()
    context = spawn.start_processes(lambda i: _end(1 if i == 0 else -9), nprocs=2, join=False,
                                    start_method="fork")
    for process in context.processes:
        process.join()
    with pytest.raises((spawn.ProcessExitedException, spawn.ProcessRaisedException)):
        while not context.join():
            pass
    assert {rank: code for rank, (_, code, _) in ended.items()} == {0: 1, 1: -9}
    assert [pid for pid, _, _ in ended.values()] == [p.pid for p in context.processes]
