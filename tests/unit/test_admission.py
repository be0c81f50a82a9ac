"""The admission decision: quotas, borrowing, priorities, fair share and whom preemption asks."""

from trnflow.backends.admission import Claim, Pool, Share, decide

MACHINE = Pool("this machine", "core", 2)
FLEET = Pool("trn1.32xlarge", "instance", 8, {"a": Share(quota=4, borrow=True), "b": Share(quota=4)})


def run(run_id: str, team: str = "default", units: int = 2, priority: int = 10, since: float = 0.0, **kw) -> Claim:
    klass = {100: "production", 10: "experiment"}.get(priority, "")
    return Claim(run_id, team, units, priority, klass, since, **kw)


def test_runs_that_find_the_machine_full_wait_in_order_of_arrival_with_the_reason():
    decision = decide(MACHINE, [], [run("r3", since=3), run("r1", since=1), run("r2", since=2)])
    assert decision.admitted == ["r1"]
    assert decision.verdicts["r2"].reason == "this machine is full, 2 of 2 cores held; 1 run ahead"
    assert decision.verdicts["r3"].reason == "behind run r2; 2 runs ahead"
    assert [decision.verdicts[r].place for r in ("r1", "r2", "r3")] == [0, 1, 2]
    assert decision.preempt == {}  # one class: nobody is asked to yield


def test_a_higher_class_goes_first_and_a_run_past_the_pool_says_so():
    decision = decide(MACHINE, [], [run("exp", since=1), run("prod", priority=100, since=2),
                                    run("huge", units=4, since=0)])
    assert decision.admitted == ["prod"]
    assert decision.verdicts["huge"].reason == "needs 4 cores, more than this machine has (2 cores)"


def test_a_production_run_asks_its_teams_experiment_to_yield_and_only_once():
    holding = [run("exp", since=5)]
    decision = decide(MACHINE, holding, [run("prod", priority=100, since=9)])
    assert decision.admitted == [] and decision.preempt == {"exp": "prod"}
    assert decision.verdicts["prod"].reason == ("this machine is full, 2 of 2 cores held; run exp (experiment) "
                                                "yielding to it at a checkpoint; 0 runs ahead")
    asked = [run("exp", since=5, yielding="prod")]
    again = decide(MACHINE, asked, [run("prod", priority=100, since=9)])
    assert again.preempt == {} and "run exp (experiment) yielding" in again.verdicts["prod"].reason
    gone = decide(MACHINE, [], [run("prod", priority=100, since=9), run("exp", since=1)])
    assert gone.admitted == ["prod"]  # and the preempted run waits its turn again


def test_the_newest_lower_runs_yield_first_and_one_preempted_too_often_is_left_alone():
    pool = Pool("this machine", "core", 4)
    holding = [run("old", since=1), run("new", since=2)]
    assert decide(pool, holding, [run("prod", priority=100)]).preempt == {"new": "prod"}
    tired = [run("old", since=1), run("new", since=2, preemptions=3)]
    assert decide(pool, tired, [run("prod", priority=100)]).preempt == {"old": "prod"}
    both = [run("old", since=1, preemptions=3), run("new", since=2, preemptions=3)]
    decision = decide(pool, both, [run("prod", priority=100)])
    assert decision.preempt == {} and decision.verdicts["prod"].reason.startswith("this machine is full")


def test_a_team_at_its_quota_waits_while_another_team_goes():
    pool = Pool("trn1.32xlarge", "instance", 8, {"a": Share(quota=4), "b": Share(quota=4)})
    decision = decide(pool, [run("a1", "a", 4)], [run("a2", "a", 2, since=1), run("a3", "a", 1, since=2),
                                                   run("b1", "b", 2, since=3)])
    assert decision.admitted == ["b1"]
    assert decision.verdicts["a2"].reason == "team a at its trn1.32xlarge quota, 4 of 4 instances; 0 runs ahead"
    assert decision.verdicts["a3"].reason == "behind run a2; 1 run ahead"  # its team's earlier run first


def test_a_team_that_may_borrow_takes_idle_quota_lent_to_it_and_the_lender_takes_it_back():
    decision = decide(FLEET, [run("a1", "a", 4, since=1)], [run("a2", "a", 3, since=2)])
    assert decision.admitted == ["a2"] and decision.verdicts["a2"].borrowed == 3
    # b may not borrow, so a's idle quota is not its
    assert decide(FLEET, [run("b1", "b", 4)], [run("b2", "b", 1)]).admitted == []
    # b wants its quota back: a run of the borrowing team yields, the lowest class first
    holding = [run("a1", "a", 4, since=1), run("a2", "a", 3, priority=100, since=2)]
    decision = decide(FLEET, holding, [run("b1", "b", 2, priority=10, since=3)])
    assert decision.preempt == {"a1": "b1"}
    assert decision.verdicts["b1"].reason.startswith(
        "trn1.32xlarge is full, 7 of 8 instances held; run a1 (experiment)")
    # whatever its class: a production run borrowing is taken back by the lender's experiment
    decision = decide(FLEET, [run("a2", "a", 7, priority=100, since=2)], [run("b1", "b", 2, priority=10, since=3)])
    assert decision.preempt == {"a2": "b1"}


def test_a_lender_that_lends_nothing_is_not_borrowed_from_and_borrowing_both_ways():
    pool = Pool("trn1.32xlarge", "instance", 8, {"a": Share(quota=4, borrow=True), "b": Share(quota=4, lend=False)})
    assert decide(pool, [], [run("a1", "a", 5)]).admitted == []
    mutual = Pool("trn1.32xlarge", "instance", 8, {"a": Share(quota=4, borrow=True), "b": Share(quota=4, borrow=True)})
    assert decide(mutual, [], [run("a1", "a", 6)]).verdicts["a1"].borrowed == 2
    assert decide(mutual, [], [run("b1", "b", 6)]).verdicts["b1"].borrowed == 2
    # b takes back what a borrowed of its quota: a's run yields
    assert decide(mutual, [run("a1", "a", 5)], [run("b1", "b", 3)]).admitted == ["b1"]
    assert decide(mutual, [run("a1", "a", 5)], [run("b1", "b", 4)]).preempt == {"a1": "b1"}


def test_another_teams_runs_within_their_quota_are_never_preempted_and_only_the_runs_needed_yield():
    pool = Pool("trn1.32xlarge", "instance", 8, {"a": Share(quota=4), "b": Share(quota=4, borrow=True)})
    holding = [run("b1", "b", 4, since=1), run("b2", "b", 2, since=2), run("b3", "b", 1, since=3)]
    decision = decide(pool, holding, [run("a1", "a", 4, priority=100, since=4)])
    assert decision.preempt == {"b3": "a1", "b2": "a1"}  # b's borrowed 3, never b1 within its quota
    decision = decide(pool, holding, [run("a1", "a", 3, priority=100, since=4)])
    assert decision.preempt == {"b2": "a1"}  # b3 alone would not do, b2 alone does: b3 is left alone
    # a run its team's quota could never take, with no borrowing: said, and holding up nobody
    decision = decide(pool, [], [run("big", "a", 6, since=1), run("a2", "a", 2, since=2)])
    assert decision.verdicts["big"].reason == ("needs 6 instances, more than team a may ever hold of trn1.32xlarge "
                                               "(4 instances: its quota)")
    assert decision.admitted == ["a2"]


def test_a_teams_small_runs_within_its_quota_never_slip_past_its_large_one():
    pool = Pool("trn1.32xlarge", "instance", 8, {"a": Share(quota=4), "b": Share(quota=4)})
    decision = decide(pool, [run("a0", "a", 2)], [run("big", "a", 4, since=1), run("small", "a", 1, since=2)])
    assert decision.admitted == [] and decision.verdicts["small"].reason == "behind run big; 1 run ahead"


def test_a_large_run_the_full_pool_stops_holds_up_the_small_ones_behind_it():
    pool = Pool("this machine", "core", 4)
    decision = decide(pool, [run("r0", units=2)], [run("big", units=4, since=1), run("small", units=2, since=2)])
    assert decision.admitted == [] and decision.verdicts["small"].reason == "behind run big; 1 run ahead"


def test_teams_of_one_class_take_turns_by_fair_share():
    pool = Pool("trn1.32xlarge", "instance", 2, {"a": Share(weight=1.0), "b": Share(weight=3.0)})
    waiting = [run("a1", "a", 2, since=1), run("b1", "b", 2, since=2)]
    assert decide(pool, [], waiting, usage={"a": 10.0, "b": 20.0}).admitted == ["b1"]  # 20/3 < 10/1
    assert decide(pool, [], waiting, usage={"a": 10.0, "b": 40.0}).admitted == ["a1"]


def test_two_production_runs_each_ask_their_own_teams_experiment_and_neither_takes_the_others():
    pool = Pool("trn1.32xlarge", "instance", 4, {"a": Share(quota=2), "b": Share(quota=2)})
    holding = [run("ea", "a", 2, since=1), run("eb", "b", 2, since=2)]
    decision = decide(pool, holding, [run("pa", "a", 2, priority=100, since=3),
                                      run("pb", "b", 2, priority=100, since=4)])
    assert decision.preempt == {"ea": "pa", "eb": "pb"}  # the second is not held up behind the first
    # a waiter that a holder yields to already is not given another's yielding run
    asked = [run("ea", "a", 2, since=1, yielding="pa"), run("eb", "b", 2, since=2)]
    assert decide(pool, asked, [run("pa", "a", 2, priority=100, since=3),
                                run("pb", "b", 2, priority=100, since=4)]).preempt == {"eb": "pb"}


def test_idle_quota_its_own_teams_waiting_runs_want_is_not_lent():
    pool = Pool("trn1.32xlarge", "instance", 4, {"a": Share(quota=2, borrow=True), "b": Share(quota=2)})
    decision = decide(pool, [], [run("a1", "a", 4, since=1), run("b1", "b", 2, since=2)])
    assert decision.admitted == ["b1"] and decision.preempt == {}
    assert decision.verdicts["a1"].reason == ("team a at its trn1.32xlarge quota, 0 of 2 instances, and no idle quota "
                                              "to borrow; 0 runs ahead")
    # with nothing of b's waiting, a borrows b's idle quota, and b's next run takes it back
    assert decide(pool, [], [run("a1", "a", 4, since=1)]).verdicts["a1"].borrowed == 2
    assert decide(pool, [run("a1", "a", 4, since=1)], [run("b1", "b", 2, since=2)]).preempt == {"a1": "b1"}


def test_a_team_short_of_idle_quota_to_borrow_holds_up_other_borrowers_not_others_within_quota():
    pool = Pool("trn1.32xlarge", "instance", 6, {"a": Share(quota=1, borrow=True), "b": Share(quota=1, borrow=True),
                                                 "c": Share(quota=2)})
    holding = [run("c0", "c", 1, since=0)]  # 2 unassigned, 1 of c's idle but wanted by c1
    waiting = [run("a1", "a", 4, since=1), run("b1", "b", 2, since=2), run("c1", "c", 1, since=3)]
    decision = decide(pool, holding, waiting)
    assert decision.admitted == ["c1"]  # within its quota, whoever waits before it
    assert decision.verdicts["b1"].reason == "behind run a1; 1 run ahead"  # no slipping past the big borrower


def test_a_team_at_its_daily_spend_waits_for_the_next_day_and_holds_up_its_own_runs_only():
    pool = Pool("trn1.32xlarge", "instance", 8, {"a": Share(daily_spend=100.0), "b": Share()})
    holding = [run("a1", "a", units=1, cost=30.0)]
    waiting = [run("a2", "a", units=1, since=1, cost=50.0), run("a3", "a", units=1, since=2, cost=5.0),
               run("b1", "b", units=1, since=3, cost=500.0)]
    decision = decide(pool, holding, waiting, spent={"a": 40.0})  # 40 spent, 30 forecast: 30 left
    assert decision.admitted == ["b1"] and decision.preempt == {}  # nobody yields for spend
    assert decision.verdicts["a2"].reason == ("team a at its daily spend limit, $70.00 of $100.00 spent or forecast "
                                              "today (this run: $50.00); 0 runs ahead")
    assert decision.verdicts["a3"].reason == "behind run a2; 1 run ahead"  # a smaller run does not slip past
    assert decide(pool, holding, waiting, spent={"a": 10.0}).admitted == ["a2", "a3", "b1"]
    huge = decide(pool, [], [run("big", "a", units=1, cost=150.0), run("a4", "a", units=1, since=1, cost=1.0)])
    assert huge.verdicts["big"].reason == "is forecast to cost $150.00, more than team a's daily spend limit ($100.00)"
    assert huge.admitted == ["a4"]  # one that can never go holds up nobody
