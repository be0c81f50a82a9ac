"""This machine's queue of runs: admission in order, reasons, yield requests, dead runs dropped, and
the local backend placing a run's jobs on the cores it holds."""

import subprocess
import sys
import textwrap

import pytest

from trnflow.backends import machine
from trnflow.backends.base import JobRequest
from trnflow.backends.local import LocalBackend
from trnflow.errors import TransientError
from trnflow.teams import UNDECLARED

FREE = staticmethod(lambda cores: False)


@pytest.fixture(autouse=True)
def own_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNFLOW_NEURON_RT_DIR", str(tmp_path / "rt"))


def enter(run_id: str, cores: int = 2, total: int = 2, klass: str = "experiment", team=UNDECLARED):
    priority = {"production": 100, "experiment": 10}[klass]
    return machine.enter(run_id, f"run {run_id}", team, klass, priority, cores, total, busy=lambda cores: False)


def test_the_first_run_holds_the_cores_and_the_next_waits_with_its_reason_until_they_are_free():
    first, second = enter("r1"), enter("r2")
    assert first.wait(lambda reason: None, poll_seconds=0) == [0, 1]
    second.look()
    assert second.entry.state == "waiting"
    assert second.entry.reason == "this machine is full, 2 of 2 cores held; 0 runs ahead"
    assert machine.reserved() == {0: "r1", 1: "r1"} and machine.held_by("r1") == [0, 1]
    assert [(e.run_id, e.state, e.place) for e in machine.entries()] == [("r1", "holding", None), ("r2", "waiting", 0)]
    first.release()
    heard = []
    assert second.wait(heard.append, poll_seconds=0) == [0, 1] and heard == []
    second.release()
    assert machine.entries() == []


def test_runs_side_by_side_on_a_larger_instance_take_aligned_ranges():
    a, b, c = enter("a", 2, 8), enter("b", 4, 8), enter("c", 2, 8)
    assert [t.wait(print, poll_seconds=0) for t in (a, b)] == [[0, 1], [4, 5, 6, 7]]
    assert c.wait(print, poll_seconds=0) == [2, 3]
    for t in (a, b, c):
        t.release()


def experiment_asked_by_production():
    """An experiment holding the machine, and a production run that has asked it to yield."""
    experiment = enter("exp")
    experiment.wait(print, poll_seconds=0)
    production = enter("prod", klass="production")
    production.look()
    return experiment, production


def test_a_production_run_asks_the_experiment_to_yield_and_goes_once_it_has_requeued():
    experiment, production = experiment_asked_by_production()
    asked = experiment.asked_to_yield()
    assert asked is not None and asked.to == "prod" and asked.label == "run prod"
    assert "exp (experiment) yielding to it at a checkpoint" in production.entry.reason
    experiment.requeue()
    assert experiment.entry.preemptions == 1 and experiment.asked_to_yield() is None
    assert production.wait(print, poll_seconds=0) == [0, 1]
    experiment.look()
    assert experiment.entry.state == "waiting" and experiment.entry.reason.startswith("this machine is full")
    production.release()
    assert experiment.wait(print, poll_seconds=0) == [0, 1]
    experiment.release()


def test_a_run_whose_process_died_leaves_no_entry_behind():
    script = textwrap.dedent("""
        import os, sys
        from trnflow.backends import machine
        from trnflow.teams import UNDECLARED
        t = machine.enter("dead", "run dead", UNDECLARED, "experiment", 10, 2, 2, busy=lambda c: False)
        t.wait(print, poll_seconds=0)
        os._exit(0)  # no release: as if killed
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    assert machine.entries() == [] and not list(machine.queue_dir().glob("*.json"))
    alive = enter("alive")
    assert alive.wait(print, poll_seconds=0) == [0, 1]
    alive.release()


def test_one_run_enters_the_queue_once():
    held = enter("twice")
    script = ("from trnflow.backends import machine\nfrom trnflow.teams import UNDECLARED\n"
              "machine.enter('twice', 'run twice', UNDECLARED, 'experiment', 10, 2, 2, busy=lambda c: False)")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode != 0 and "in this machine's queue already" in run.stderr
    held.release()


def test_the_local_backend_places_a_runs_jobs_on_its_cores_and_others_off_them(make_spec, tmp_path):
    spec = make_spec(compute={"instance_type": "trn1.32xlarge", "cores_per_node": 2})
    backend = LocalBackend(tmp_path / "jobs")
    ticket = enter("mine", 2, 32)
    ticket.wait(print, poll_seconds=0)
    other = enter("other", 2, 32)
    other.wait(print, poll_seconds=0)
    assert ticket.cores == [0, 1] and other.cores == [2, 3]
    assert backend._place(JobRequest(spec, "sanity", "mine")) == [0, 1]
    assert backend._place(JobRequest(spec, "sanity", "other")) == [2, 3]
    assert backend._place(JobRequest(spec, "sanity", "no-run")) == [4, 5]  # a job of no run in the queue
    # a bad core found by the preflight: the run moves to cores no other run holds
    assert backend._place(JobRequest(spec, "sanity", "mine", exclude_cores=frozenset({1}))) == [4, 5]
    assert machine.held_by("mine") == [4, 5]
    ticket.release()
    other.release()


def test_a_job_of_no_run_waits_while_runs_hold_every_core(make_spec, tmp_path):
    spec = make_spec()
    ticket = enter("holder")
    ticket.wait(print, poll_seconds=0)
    with pytest.raises(TransientError, match="held by runs in this machine's queue: nc0 by run holder"):
        LocalBackend(tmp_path / "jobs")._place(JobRequest(spec, "compile", "someone-else"))
    ticket.release()


def test_trnflow_queue_lists_who_holds_the_cores_and_who_waits_and_why():
    import json

    from typer.testing import CliRunner

    from trnflow.cli.app import app

    assert "no run holds or waits" in CliRunner().invoke(app, ["queue"]).output
    first, second = enter("r1"), enter("r2")
    first.wait(print, poll_seconds=0)
    second.look()
    listed = json.loads(CliRunner().invoke(app, ["queue", "--json"]).output)
    assert [(e["run_id"], e["state"], e["cores"]) for e in listed] == [("r1", "holding", [0, 1]), ("r2", "waiting", [])]
    assert listed[1]["reason"] == "this machine is full, 2 of 2 cores held; 0 runs ahead"
    table = CliRunner().invoke(app, ["queue"]).output
    assert all(word in table for word in ("holding", "waiting", "experiment", "default"))
    first.release()
    second.release()


def test_a_run_that_cannot_move_off_a_bad_core_is_told_why(make_spec, tmp_path):
    from trnflow.errors import FatalError

    ticket = enter("short")
    ticket.wait(print, poll_seconds=0)
    with pytest.raises(FatalError, match="only 1 healthy NeuronCore"):  # the instance itself is short of cores
        LocalBackend(tmp_path / "jobs")._place(JobRequest(make_spec(), "sanity", "short", exclude_cores=frozenset({1})))
    ticket.release()
    wide, other = enter("wide", 2, 4), enter("other", 2, 4)
    wide.wait(print, poll_seconds=0)
    other.wait(print, poll_seconds=0)
    with pytest.raises(TransientError, match="other runs hold the other healthy cores"):
        wide.move(frozenset({0}))
    wide.release()
    other.release()


def test_the_expected_wait_plays_the_queue_forward_on_the_runs_forecasts():
    holder = machine.enter("h", "run h", UNDECLARED, "experiment", 10, 2, 4, busy=lambda c: False, expected_s=600)
    holder.wait(print, poll_seconds=0)
    waiter = machine.enter("w", "run w", UNDECLARED, "experiment", 10, 4, 4, busy=lambda c: False, expected_s=300)
    waiter.look()
    now = holder.entry.admitted
    found = machine.entries()

    def newcomer(cores: int, klass: str = "experiment", expected: float | None = 100):
        return machine.newcomer("new", "this run", UNDECLARED, klass, {"production": 100, "experiment": 10}[klass],
                                 cores, 4, expected)

    # 2 cores are free now, but run w (the whole machine) is ahead and holds up those behind it
    assert machine.expected_wait(newcomer(2), found, now) == (900.0, "")  # h ends at 600, then w takes 300
    assert machine.expected_wait(newcomer(2, "production"), found, now) == (0.0, "")  # goes before w, on free cores
    unknown = [e.model_copy(update={"expected_s": None}) if e.run_id == "w" else e for e in found]
    assert machine.expected_wait(newcomer(2), unknown, now) == (None, "run w has no forecast")
    wait, why = machine.expected_wait(newcomer(8), found, now)
    assert wait is None and "more than this machine has" in why
    holder.release()
    waiter.release()


def test_plan_adds_the_expected_wait_in_this_machines_queue(tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from tests.conftest import quickstart_data
    from trnflow.cli.app import app

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(registry_url=str(tmp_path / "registry"))))
    quiet = json.loads(CliRunner().invoke(app, ["plan", str(path), "--json"]).stdout)
    assert not any(n.startswith("queue:") for n in quiet["notes"])
    holder = machine.enter("h", "run h", UNDECLARED, "experiment", 10, 2, 2, busy=lambda c: False, expected_s=1200)
    holder.wait(print, poll_seconds=0)
    notes = json.loads(CliRunner().invoke(app, ["plan", str(path), "--json"]).stdout)["notes"]
    (queued,) = [n for n in notes if n.startswith("queue:")]
    assert queued.startswith("queue: 1 run holds or waits for this machine's cores; this run would wait about 20")
    holder.release()


def test_a_yield_request_lapses_with_the_run_that_made_it_and_a_run_past_training_is_never_asked():
    experiment, production = experiment_asked_by_production()
    assert experiment.asked_to_yield() is not None
    production.release()  # it went away (cancelled, or admitted elsewhere): the request lapses
    assert experiment.asked_to_yield() is None and machine.yield_request("exp") is None
    experiment.past_yielding()
    again = enter("prod2", klass="production")
    again.look()
    assert experiment.asked_to_yield() is None
    assert again.entry.reason == "this machine is full, 2 of 2 cores held; 0 runs ahead"  # nobody yielding to it
    again.release()
    experiment.release()


def test_teams_share_this_machine_by_their_declared_quotas_whether_or_not_they_have_runs_here(tmp_path):
    from trnflow.teams import Team

    def team(name: str, **share) -> Team:
        return Team(name=name, checkpoints=str(tmp_path / name), registry=str(tmp_path / f"{name}-r"),
                    outputs=str(tmp_path / f"{name}-o"), cache=str(tmp_path / f"{name}-c"), **share)

    search, ads = team("search", quotas={"local": 2}, borrow=True), team("ads", quotas={"local": 2}, lend=False)
    declared = [search, ads]
    first = machine.enter("s1", "run s1", search, "experiment", 10, 2, 4, busy=lambda c: False, teams=declared)
    first.wait(print, poll_seconds=0)
    second = machine.enter("s2", "run s2", search, "experiment", 10, 2, 4, busy=lambda c: False, teams=declared)
    second.look()  # ads has no run here, but its idle quota is not lent
    assert second.entry.reason.startswith("team search at its this machine quota, 2 of 2 cores, and no idle quota")
    second.release()
    first.release()


def test_runs_of_one_class_on_this_machine_go_by_fair_share_of_what_their_teams_hold(tmp_path):
    from trnflow.teams import Team

    def team(name: str) -> Team:
        return Team(name=name, checkpoints=str(tmp_path / name), registry=str(tmp_path / f"{name}-r"),
                    outputs=str(tmp_path / f"{name}-o"), cache=str(tmp_path / f"{name}-c"))

    search, ads = team("search"), team("ads")

    def go(run_id: str, who: Team, cores: int, expected: float):
        return machine.enter(run_id, f"run {run_id}", who, "experiment", 10, cores, 4, busy=lambda c: False,
                             expected_s=expected)

    long = go("long", search, 2, 3600)
    long.wait(print, poll_seconds=0)
    blocker = go("blocker", ads, 2, 60)
    blocker.wait(print, poll_seconds=0)
    search_next, ads_next = go("search-next", search, 2, 60), go("ads-next", ads, 2, 60)  # search arrived first
    blocker.release()
    ads_next.look()
    search_next.look()
    assert ads_next.entry.state == "holding"  # search still holds an hour's cores: ads goes first
    assert search_next.entry.reason.startswith("this machine is full")
    for t in (long, search_next, ads_next):
        t.release()


def test_a_job_on_fewer_cores_than_its_run_holds_stays_on_them_off_a_bad_one(make_spec, tmp_path):
    ticket = enter("shrunk")
    ticket.wait(print, poll_seconds=0)
    one_core = make_spec(cores=1)  # the run trains on the core left after nc1 failed
    placed = LocalBackend(tmp_path / "jobs")._place(JobRequest(one_core, "train", "shrunk",
                                                              exclude_cores=frozenset({1})))
    assert placed == [0] and machine.held_by("shrunk") == [0, 1]
    ticket.release()


def test_a_runs_cost_counts_toward_its_teams_spend_today_and_a_run_past_it_waits(tmp_path, monkeypatch):
    from trnflow.backends import runqueue
    from trnflow.teams import UNDECLARED

    monkeypatch.setattr(runqueue, "today", lambda: "2026-12-06")  # one day, whenever the test runs
    today = runqueue.today

    frugal = UNDECLARED.model_copy(update={"daily_spend_usd": 10.0})
    first = machine.enter("s1", "run s1", frugal, "experiment", 10, 2, 8, busy=lambda c: False, cost_usd=6.0)
    first.wait(print, poll_seconds=0)
    second = machine.enter("s2", "run s2", frugal, "experiment", 10, 2, 8, busy=lambda c: False, cost_usd=6.0)
    second.look()
    assert second.entry.state == "waiting" and "daily spend limit, $6.00 of $10.00" in second.entry.reason
    first.release(cost_usd=7.5)  # it cost more than forecast
    assert machine.FILES.spent(today()) == {UNDECLARED.name: 7.5}
    second.look()
    assert second.entry.state == "waiting" and "$7.50 of $10.00" in second.entry.reason
    second.release()
    assert (machine.queue_dir() / f"spend-{today()}.day").is_file()

    third = machine.enter("s3", "run s3", frugal, "experiment", 10, 2, 8, busy=lambda c: False, cost_usd=2.0)
    third.wait(print, poll_seconds=0)
    third.requeue(cost_usd=1.5)  # it yielded: what it spent so far counts now, its forecast holds the rest
    assert machine.FILES.spent(today()) == {UNDECLARED.name: 9.0} and third.entry.cost_usd == 0.5
    third.wait(print, poll_seconds=0)
    third.release(cost_usd=2.25)  # only what it spent since
    assert machine.FILES.spent(today()) == {UNDECLARED.name: 9.75}
