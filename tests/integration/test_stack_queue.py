"""The stack's queue of cloud runs on a real Prefect server: two teams each asking for more than
their quota never hold more than the stack has, wait with the quota named, borrow each other's idle
quota and get their own back by preemption; a dead orchestrator's entry and slots are let go."""

import json
import threading
import time

import pytest
import yaml
from typer.testing import CliRunner

from tests.clouds import cloud_spec
from trnflow.backends import queue_wait, stack_queue
from trnflow.backends.runqueue import entry_for
from trnflow.cli.app import app
from trnflow.flows._queue import ENTRY, PREFECT_QUEUE, variable_name
from trnflow.teams import Teams

KIND = "trn1.32xlarge"


@pytest.fixture
def teams(prefect_api) -> Teams:
    """Teams a and b, 2 trn1.32xlarge each, both borrowing and lending; c, 1, never borrowing."""
    def team(name: str, quota: int, borrow: bool) -> dict:
        return {"name": name, "checkpoints": f"s3://b/{name}/ck/", "registry": f"s3://b/{name}/reg/",
                "outputs": f"s3://b/{name}/out/", "cache": f"s3://b/{name}/cache/", "quotas": {KIND: quota},
                "borrow": borrow}
    return Teams.model_validate({"teams": [team("a", 2, True), team("b", 2, True), team("c", 1, False)]})


def _enter(teams: Teams, team: str, run_id: str, instances: int, klass: str = "experiment"):
    who = teams.named(team)
    capacity = stack_queue.capacity_of(teams, KIND)
    entry = entry_for(run_id, f"run {run_id}", who, klass, {"production": 100, "experiment": 10}[klass], instances,
                      capacity, KIND, "instance", KIND, expected_s=600, teams=list(teams.teams))
    return stack_queue.enter(entry, who, PREFECT_QUEUE)


class Watch:
    """Reads the queue under its lock, over and over, and keeps what each team held at each moment."""

    def __init__(self, teams: Teams):
        self.teams, self.seen, self.limits, self.errors = teams, [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # said by the test, which would otherwise pass on what was seen before
            self.errors.append(exc)

    def _watch(self) -> None:
        while not self._stop.is_set():
            with PREFECT_QUEUE.deciding():
                found = PREFECT_QUEUE.entries()
            held: dict[str, int] = {}
            for e in found:
                if e.state == "holding":
                    held[e.team] = held.get(e.team, 0) + e.units
            self.seen.append(held)
            self.limits.append(PREFECT_QUEUE.limits())
            time.sleep(0.5)  # each look takes the queue's lock: the runs' own looks go first

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_two_teams_over_quota_borrow_both_ways_and_never_hold_more_than_the_stack(teams, make_spec, tmp_path,
                                                                                  monkeypatch):
    assert stack_queue.capacity_of(teams, KIND) == 5
    watch = Watch(teams)
    tickets = []
    try:
        a = [_enter(teams, "a", f"a{n}", 1) for n in range(4)]  # a asks for 4: its 2, then b's and c's idle ones
        tickets += a
        for t in a:
            t.look()
        assert [t.entry.state for t in a] == ["holding", "holding", "holding", "holding"]
        limits = PREFECT_QUEUE.limits()
        assert limits[f"trnflow-{KIND}"] == (4, 5) and limits[f"trnflow-a-{KIND}"] == (4, 5)

        c = [_enter(teams, "c", f"c{n}", 1) for n in range(2)]  # c wants its 1 back; c never borrows
        tickets += c
        c[0].look()
        c[1].look()
        assert c[0].entry.state == "holding"  # the stack's fifth instance was free
        assert c[1].entry.state == "waiting" and f"team c at its {KIND} quota, 1 of 1 instance" in c[1].entry.reason

        b = _enter(teams, "b", "b0", 2)  # b wants its 2 back from a, which borrowed them
        tickets.append(b)
        b.look()
        assert b.entry.state == "waiting" and "yielding to it at a checkpoint" in b.entry.reason, b.entry.reason
        asked = [t for t in a if t.asked_to_yield() is not None]
        assert sorted(t.entry.run_id for t in asked) == ["a2", "a3"]  # the newest, on borrowed capacity
        assert {t.asked_to_yield().to for t in asked} == {"b0"}
        for t in asked:  # each checkpoints at its next step boundary and queues again
            t.requeue()
        b.look()
        assert b.entry.state == "holding"
        listed = json.loads(CliRunner().invoke(app, ["queue", "--stack", "--json"]).output)
        assert [(r["run_id"], r["state"]) for r in listed["runs"]] == [
            ("a0", "holding"), ("a1", "holding"), ("c0", "holding"), ("b0", "holding"), ("c1", "waiting"),
            ("a2", "waiting"), ("a3", "waiting")]
        assert listed["limits"][f"trnflow-{KIND}"] == {"held": 5, "limit": 5}
        assert listed["limits"][f"trnflow-c-{KIND}"] == {"held": 1, "limit": 1}  # c may not borrow: its quota
        reasons = {r["run_id"]: r["reason"] for r in listed["runs"]}
        assert reasons["c1"].startswith(f"team c at its {KIND} quota, 1 of 1 instance"), reasons
        shown = CliRunner().invoke(app, ["queue", "--stack"]).output  # the reasons: in the JSON above
        assert all(word in shown for word in ("holding", "waiting", f"trnflow-c-{KIND}")), shown
        # `trnflow plan`'s figure: a run of b starting now waits for the holders' forecasts to end
        (tmp_path / "teams.yaml").write_text(yaml.safe_dump(teams.model_dump(mode="json")))
        monkeypatch.setenv("TRNFLOW_TEAMS", str(tmp_path / "teams.yaml"))
        spec = cloud_spec(make_spec, "bucket", "batch", compute={"nodes": 1})
        wait, why, found = queue_wait(spec, teams.named("b"), 600.0, PREFECT_QUEUE)
        assert found == 7 and why == "" and 0 < wait <= 600, (wait, why)
        asked[0].look()
        assert asked[0].entry.state == "waiting" and asked[0].entry.reason, asked[0].entry

        b2 = _enter(teams, "b", "b1", 1)  # now b borrows: a ends two runs, and its quota lies idle
        tickets.append(b2)
        for t in a[:2]:
            t.release()
        b2.look()
        for t in asked:
            t.look()
        assert sorted(t.entry.run_id for t in (*asked, b2) if t.entry.state == "holding") == ["a2", "a3"]
        assert b2.entry.state == "waiting"  # a's own waiting runs want its quota first: nothing idle to lend
        asked[0].release()
        b2.look()
        assert b2.entry.state == "holding"  # a holds 1 of its 2: b borrows the other
        with PREFECT_QUEUE.deciding():
            found = PREFECT_QUEUE.entries()
        assert {e.run_id for e in found if e.state == "holding"} == {"a3", "c0", "b0", "b1"}
        assert {e.run_id for e in found if e.state == "waiting"} == {"c1"}
    finally:
        for t in tickets:
            if stack_queue.ticket(t.entry.run_id) is not None:
                t.release()
        watch.stop()
    assert watch.errors == [] and len(watch.seen) > 10, (watch.errors, watch.seen)
    assert all(sum(h.values()) <= 5 for h in watch.seen), watch.seen
    assert all(h.get("c", 0) <= 1 for h in watch.seen)  # c may not borrow
    for h in watch.seen:  # a team over its quota only borrows what others leave idle
        for team, quota in (("a", 2), ("b", 2)):
            assert h.get(team, 0) - quota <= sum(max(0, q - h.get(t, 0)) for t, q in (("a", 2), ("b", 2), ("c", 1))
                                                 if t != team), h
    assert all(lim.get(f"trnflow-{KIND}", (0, 5))[0] <= 5 for lim in watch.limits)
    assert PREFECT_QUEUE.limits()[f"trnflow-{KIND}"][0] == 0  # every slot given back
    with PREFECT_QUEUE.deciding():
        assert PREFECT_QUEUE.entries() == []


def test_a_dead_orchestrators_entry_is_dropped(teams):
    ghost = entry_for("ghost", "run ghost", teams.named("a"), "experiment", 10, 1, 5, KIND, "instance", KIND)
    PREFECT_QUEUE.put(ghost.model_copy(update={"beat": time.time() - stack_queue.STALE_SECONDS - 1}))
    with PREFECT_QUEUE.deciding():
        assert [e.run_id for e in PREFECT_QUEUE.entries()] == []
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_variable_by_name(variable_name(ENTRY, "ghost")) is None


def test_a_rerun_takes_the_place_of_its_dead_process_on_this_host_and_never_of_a_live_one(teams):
    import subprocess
    import sys

    from trnflow.errors import TransientError

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = entry_for("again", "run again", teams.named("a"), "experiment", 10, 1, 5, KIND, "instance", KIND)
    PREFECT_QUEUE.put(dead.model_copy(update={"pid": int(ended.stdout)}))
    rerun = _enter(teams, "a", "again", 1)  # its first process died a moment ago: no wait for its heartbeat
    with pytest.raises(TransientError, match="in the stack's queue already, from process"):
        _enter(teams, "a", "again", 1)  # this process is alive
    rerun.release()
