"""The stall limit that follows the training steps' pace, and the peers a waiting rank names, read
from a real TCPStore as the launcher's."""

import subprocess
import sys
import textwrap
import types

import pytest
import torch.distributed as dist

from trnflow.workload import watchdog
from trnflow.workload.pace import MEASURED, StepPace, slow_ranks


def _ctx(rank: int, world: int, logged: list | None = None):
    return types.SimpleNamespace(rank=rank, world_size=world, core_id=rank + 4,
                                 log=lambda event, **fields: (logged if logged is not None else []).append(fields))


@pytest.fixture
def no_pace():
    yield
    watchdog.pace(None)


def test_the_limit_holds_once_steps_after_the_first_are_measured_and_lets_go_with_the_loop(no_pace):
    pace = StepPace(_ctx(0, 1), factor=3.0, floor=5.0)
    pace.begun(1)
    pace.ended(40.0)  # the first step compiles: never measured
    for step, seconds in enumerate([0.2, 0.4] + [0.3] * (MEASURED - 2), start=2):
        assert watchdog.held() is None
        pace.begun(step)
        pace.ended(seconds)
    held = watchdog.held()
    assert held is not None and held.limit == pytest.approx(5.0 + 3 * 0.3)
    assert held.why == "3 x its median step of 0.30 s + 5 s: compute.hang_step_factor, compute.hang_floor_seconds"
    assert held.behind() == (MEASURED + 1, [])  # one rank: nobody to wait for
    pace.close()
    assert watchdog.held() is None


def test_without_a_factor_only_the_run_limit_holds(no_pace):
    pace = StepPace(_ctx(0, 2), factor=None, floor=5.0)
    assert pace.store is None
    for step in range(1, 10):
        pace.begun(step)
        pace.ended(0.1)
    assert watchdog.held() is None


def test_a_waiting_rank_names_the_peers_that_got_less_far_in_its_step(monkeypatch, no_pace):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    ranks = [StepPace(_ctx(r, 4), factor=3.0, floor=5.0) for r in range(4)]
    for step in range(1, 8):
        for r in (0, 1, 2):
            ranks[r].begun(step)
            ranks[r].reached()
    ranks[0].begun(8)
    ranks[0].reached()  # rank 0 waits in step 8's all-reduce
    ranks[2].begun(8)  # rank 2 never finished its own work in step 8; rank 1 never began it; rank 3 nothing
    host = watchdog.host_label()
    assert ranks[0].behind() == (8, [
        watchdog.Peer(1, 5, host, "last began step 7"),
        watchdog.Peer(2, 6, host, "began step 8 but never finished its own work in it"),
        watchdog.Peer(3, None, "its host", "had not begun a step of this attempt")])
    assert ranks[1].behind() == (7, [watchdog.Peer(3, None, "its host", "had not begun a step of this attempt")])
    for r in (0, 1, 2):
        ranks[r].rewound()  # a rollback: every rank goes back, and a rank that has not yet is behind
    ranks[1].begun(5)
    assert [p.rank for p in ranks[1].behind()[1]] == [0, 2, 3]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")  # the next attempt hears nothing of this one's
    assert StepPace(_ctx(0, 4), factor=3.0, floor=5.0).behind() == (0, [])


def test_a_batch_of_another_shape_is_held_to_the_run_limit_while_it_may_compile(no_pace):
    pace = StepPace(_ctx(0, 1), factor=3.0, floor=5.0)
    for step in range(1, MEASURED + 3):
        pace.begun(step, rows=16)
        pace.ended(0.1, rows=16)
    assert watchdog.held() is not None
    pace.begun(MEASURED + 3, rows=9)  # the epoch's last, partial batch (train.drop_last: false)
    assert watchdog.held() is None
    pace.ended(2.0, rows=9)
    assert watchdog.held() is not None


def test_a_store_that_went_away_is_logged_and_the_limit_still_holds(monkeypatch, no_pace):
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    logged: list = []
    pace = StepPace(_ctx(0, 2, logged), factor=3.0, floor=5.0)
    del master  # the launcher's store is gone
    for step in range(1, MEASURED + 2):
        pace.begun(step)
        pace.ended(0.1)
    assert pace.store is None and logged and logged[0]["store"].startswith("unreachable")
    assert watchdog.held() is not None and pace.behind() == (MEASURED + 1, [])


def test_the_watchdog_ends_a_rank_over_its_pace_though_the_run_limit_is_far(tmp_path):
    """In a process of its own (the watchdog ends its process): a run limit of an hour, a pace of
    half a second, then nothing: the report quotes the pace, and the process ends as failed."""
    script = textwrap.dedent("""
        import time
        from trnflow.workload import watchdog

        def stalled(seconds, label, pace):
            print(f"stalled after {seconds:.1f} s over {pace.limit} s ({pace.why}); last: {label}", flush=True)

        watchdog.start(3600, stalled)
        watchdog.beat("train step 9")
        watchdog.pace(watchdog.Pace(0.5, "the test's pace"))
        time.sleep(120)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "over 0.5 s (the test's pace); last: train step 9" in done.stdout


def test_a_rank_over_its_peers_median_by_the_factor_is_named_slow():
    heard = [(0.10, 0, "algo-1"), (0.21, 1, "algo-1"), (0.11, 2, "algo-2"), (0.09, 3, "algo-2")]
    [slow] = slow_ranks(heard, 1.5, step=40)
    assert (slow.rank, slow.core, slow.host, slow.step) == (1, 1, "algo-1", 40)
    assert slow.peers_seconds == 0.10 and slow.ratio == 2.1  # the median of ranks 0, 2 and 3
    assert str(slow) == "rank 1 (nc1 on algo-1): 2.1x its peers' median step"
    assert slow_ranks(heard, 2.5, step=40) == []
    assert slow_ranks([(0.1, 0, "a"), (0.4, 1, "a")], 1.5, step=2)[0].rank == 1  # two ranks: each its peer's
    assert slow_ranks([(None, 0, "a"), (None, 1, "a")], 1.5, step=1) == []  # the window held the first step only
