"""Days of a shared fleet, simulated: 20 teams submit training runs to 64 trn1.32xlarge instances,
and trnflow's own admission (`trnflow.backends.admission.decide`) says who runs, who waits and who
yields. Simulated time, no jobs: a day takes seconds.

Each day's teams and runs come from its own seed: weights 1, 2 or 4; runs of 1, 2 or 4 instances
(never more than the team's quota), 10 minutes to 4 hours long (median 1 hour), 15% of them
production, arriving at random over the first 20 hours, about 1.4 times the fleet in all, so every
team always has runs waiting. Each team's quota is its weight's share of three quarters of the
fleet, rounded down; the rest is no one's, and every team may borrow it and what others leave idle
(and their own waiting runs do not want). Waiting runs of one class are ordered by the usage of
their team, charged for its holders' runs to their end when admitted, over its weight.

A run asked to yield stops at its next step boundary and writes a checkpoint (up to one step plus
one checkpoint, `STEP_S + CHECKPOINT_S`), then queues again and resumes where it stopped: it redoes
no work. The fair baseline, on the same submissions: one queue, first come first served, no classes,
quotas or preemption (a single Batch FIFO queue). Figures, beside the baseline's where it has one:

- each team's share of the day's instance-hours against its weight's share (the worst team on the
  worst day, |share / weight - 1|): goal within 10%;
- production runs' median wait from arrival to admission (the worst day): goal under one step plus
  one checkpoint;
- moments over quota (the fleet over its size; a team's run within its quota that cannot have it
  back, because more is lent out than is free or being given back): goal none;
- work lost to preemption: none redone; the instance-hours spent stopping and checkpointing, against
  what killing each run back to its last periodic checkpoint would have redone; idle capacity while
  runs waited.

    .venv/bin/python benchmarks/fleet.py [--days 8] [--seed 1] [--teams 20] [--instances 64]
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import difference_figure, emit, limit_figure, ratio_figure

from trnflow.backends.admission import Claim, Pool, Share, decide

DAY_S = 24 * 3600.0
STEP_S = 30.0
"""One training step of a large run."""
CHECKPOINT_S = 60.0
"""Writing one checkpoint."""
PERIODIC_CHECKPOINT_S = 1800.0
"""How often runs checkpoint on their own: what a run killed without warning loses, at most."""
PRODUCTION_SHARE = 0.15
CLASSES = {"production": 100, "experiment": 10}


@dataclass
class Run:
    run_id: str
    team: str
    units: int
    work_s: float
    """Instance-time it needs, per instance: its length when it runs unstopped."""
    priority_class: str
    arrived: float
    done_s: float = 0.0
    preemptions: int = 0
    admitted: list[float] = field(default_factory=list)
    started: float | None = None
    generation: int = 0
    """Bumped when it stops, so a completion scheduled before then is ignored."""
    yielding: str | None = None
    production: bool = False
    """Submitted as production (the FIFO baseline runs it as any other run)."""

    def claim(self, holding: bool) -> Claim:
        since = self.started if holding and self.started is not None else self.arrived
        return Claim(self.run_id, self.team, self.units, CLASSES[self.priority_class], self.priority_class, since,
                     self.preemptions, self.yielding if holding else None)


@dataclass
class Day:
    """What one policy made of the day."""

    used: dict[str, float]
    """Instance-seconds each team held within the day."""
    production_waits: list[float]
    preemptions: int
    overruns: int
    yield_instance_s: float
    """Instance-seconds spent stopping at a step boundary and checkpointing, for preemptions."""
    kill_instance_s: float
    """What the same preemptions would have cost as kills: the work since the last periodic checkpoint."""
    idle_while_waiting_s: float
    """Instance-seconds idle while some run waited."""
    completed: int


def teams_of(rng: random.Random, count: int, instances: int) -> dict[str, Share]:
    """Weights 1, 2 or 4; quotas their share of three quarters of the fleet, rounded down (no team's
    quota passes its fair share; what rounding leaves is no one's too)."""
    weights = {f"team-{n:02d}": rng.choice((1.0, 2.0, 4.0)) for n in range(count)}
    total = sum(weights.values())
    quotas = {t: int(instances * 0.75 * w / total) for t, w in weights.items()}
    return {t: Share(quota=quotas[t], weight=weights[t], borrow=True, lend=True) for t in weights}


def submissions(rng: random.Random, shares: dict[str, Share], instances: int) -> list[Run]:
    """Each team's runs over the day: 1.4 times its weight's share of the fleet, arriving at random
    over its first 20 hours, so that every team has runs waiting until the day's end."""
    total = sum(s.weight for s in shares.values())
    runs = []
    for team, share in shares.items():
        budget = 1.4 * instances * DAY_S * share.weight / total
        while budget > 0:
            production = rng.random() < PRODUCTION_SHARE
            units = min(rng.choice((1, 2) if production else (1, 2, 4)), share.quota or 1)  # within its quota
            work = min(4 * 3600.0, max(600.0, rng.lognormvariate(8.2, 0.6)))  # median 1 h
            runs.append(Run(f"{team}-{len(runs)}", team, units, work, "production" if production else "experiment",
                            arrived=rng.uniform(0.0, 20 * 3600.0), production=production))
            budget -= units * work
    return sorted(runs, key=lambda r: r.arrived)


def simulate(runs: list[Run], pool: Pool, policy: str, rng: random.Random) -> Day:
    """Run the day through `decide` (`policy` "trnflow": `pool` as given; "fifo": one class, no quotas)."""
    runs = [replace(r, admitted=[]) for r in runs]
    fifo = policy == "fifo"
    if fifo:
        pool = Pool(pool.name, pool.unit, pool.capacity)
        runs = [replace(r, priority_class="experiment") for r in runs]
    by_id = {r.run_id: r for r in runs}
    events: list[tuple[float, int, str, str, int]] = []  # (time, order, kind, run id, generation)
    for n, r in enumerate(runs):
        heapq.heappush(events, (r.arrived, n, "arrive", r.run_id, 0))
    seq = len(runs)
    waiting: dict[str, Run] = {}
    holding: dict[str, Run] = {}
    used = {t: 0.0 for t in {r.team for r in runs}}
    production_waits: list[float] = []
    preemptions = overruns = completed = 0
    yield_s = kill_s = idle_waiting = 0.0
    now = 0.0
    while events:
        at = events[0][0]
        span = min(at, DAY_S) - min(now, DAY_S)
        if span > 0:
            for r in holding.values():
                used[r.team] += r.units * span
            if waiting:
                idle_waiting += (pool.capacity - sum(r.units for r in holding.values())) * span
        for r in holding.values():
            if r.yielding is None:  # a run stopping at a step boundary makes no progress worth keeping
                r.done_s += at - now
        now = at
        while events and events[0][0] == now:
            _, _, kind, run_id, generation = heapq.heappop(events)
            run = by_id[run_id]
            if kind == "arrive":
                waiting[run_id] = run
            elif kind == "end" and generation == run.generation and run_id in holding:
                del holding[run_id]
                completed += 1
            elif kind == "yielded" and generation == run.generation and run_id in holding:
                del holding[run_id]
                run.generation += 1
                run.preemptions += 1
                run.yielding = None
                waiting[run_id] = run
        usage = None if fifo else fair_share_usage(used, holding.values())
        decision = decide(pool, [r.claim(True) for r in holding.values()], [r.claim(False) for r in waiting.values()],
                          usage=usage)
        for run_id in decision.admitted:
            run = waiting.pop(run_id)
            holding[run_id] = run
            run.started = now
            run.admitted.append(now)
            if len(run.admitted) == 1 and run.production:
                production_waits.append(now - run.arrived)
            seq += 1
            heapq.heappush(events, (now + max(0.0, run.work_s - run.done_s), seq, "end", run_id, run.generation))
        for victim_id, to in decision.preempt.items():
            victim = holding[victim_id]
            victim.yielding = to
            preemptions += 1
            stop = rng.uniform(0.0, STEP_S) + CHECKPOINT_S  # to the next step boundary, then a checkpoint
            yield_s += victim.units * stop
            kill_s += victim.units * (victim.done_s % PERIODIC_CHECKPOINT_S)
            seq += 1
            heapq.heappush(events, (now + stop, seq, "yielded", victim_id, victim.generation))
        overruns += _overrun(pool, list(holding.values()), list(waiting.values()))
    return Day(used, production_waits, preemptions, overruns, yield_s, kill_s, idle_waiting, completed)


def fair_share_usage(used: dict[str, float], holding) -> dict[str, float]:
    """What orders waiting runs of one class: each team's instance-seconds so far, and what its runs
    now holding will use to their forecast end (charged when admitted, so that a team whose past
    usage is low is not given many long runs at once)."""
    usage = dict(used)
    for r in holding:
        usage[r.team] += r.units * max(0.0, r.work_s - r.done_s)
    return usage


def _overrun(pool: Pool, holding: list[Run], waiting: list[Run]) -> int:
    """1 when the fleet is over its size, a team that may not borrow is over its quota, or a team's
    next run, which fits its quota, cannot have it back: more of it is lent out than is free or
    being given back by runs yielding; else 0."""
    held = {t: 0 for t in pool.shares}
    for r in holding:
        held[r.team] = held.get(r.team, 0) + r.units
    if sum(held.values()) > pool.capacity:
        return 1
    if any(u > pool.quota(t) and not pool.share(t).borrow for t, u in held.items() if pool.limits(t)):
        return 1
    free = pool.capacity - sum(held.values()) + sum(r.units for r in holding if r.yielding is not None)
    first: dict[str, Run] = {}  # each team's next run: its later ones wait behind it by the team's own order
    for w in sorted(waiting, key=lambda r: (-CLASSES[r.priority_class], r.arrived)):
        first.setdefault(w.team, w)
    starved = [w for w in first.values() if pool.limits(w.team) and held[w.team] + w.units <= pool.quota(w.team)
               and w.units > free]
    return int(bool(starved))


def shares_error(day: Day, shares: dict[str, Share]) -> tuple[float, dict[str, float]]:
    """Each team's share of the day's instance-hours over its weight's share, and the worst |that - 1|."""
    total_used, total_weight = sum(day.used.values()), sum(s.weight for s in shares.values())
    ratios = {t: (day.used[t] / total_used) / (shares[t].weight / total_weight) for t in shares}
    return max(abs(r - 1.0) for r in ratios.values()), ratios


def one_day(seed: int, teams: int, instances: int) -> dict:
    """One simulated day under trnflow's admission and under FIFO, on the same submissions."""
    rng = random.Random(seed)
    shares = teams_of(rng, teams, instances)
    runs = submissions(rng, shares, instances)
    pool = Pool("trn1.32xlarge", "instance", instances, shares)
    ours = simulate(runs, pool, "trnflow", random.Random(seed + 1))
    fifo = simulate(runs, pool, "fifo", random.Random(seed + 1))
    hours = 3600.0
    return {"seed": seed, "runs": len(runs), "production_runs": sum(r.production for r in runs),
            "share_error": shares_error(ours, shares)[0], "fifo_share_error": shares_error(fifo, shares)[0],
            "shares": {t: round(r, 3) for t, r in sorted(shares_error(ours, shares)[1].items())},
            "production_median_wait_s": statistics.median(ours.production_waits),
            "fifo_production_median_wait_s": statistics.median(fifo.production_waits),
            "production_p90_wait_s": _p90(ours.production_waits),
            "preemptions": ours.preemptions, "overruns": ours.overruns, "completed": ours.completed,
            "yield_instance_hours": ours.yield_instance_s / hours, "kill_instance_hours": ours.kill_instance_s / hours,
            "idle_while_waiting_instance_hours": ours.idle_while_waiting_s / hours,
            "fifo_idle_while_waiting_instance_hours": fifo.idle_while_waiting_s / hours}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--days", type=int, default=8, help="Days simulated, each from its own seed.")
    parser.add_argument("--seed", type=int, default=1, help="The first day's seed.")
    parser.add_argument("--teams", type=int, default=20)
    parser.add_argument("--instances", type=int, default=64)
    args = parser.parse_args(argv)
    days = [one_day(args.seed + n, args.teams, args.instances) for n in range(args.days)]
    bound = STEP_S + CHECKPOINT_S
    print(f"{args.teams} teams, {args.instances} trn1.32xlarge, {args.days} simulated days "
          f"(one step {STEP_S:.0f} s, one checkpoint {CHECKPOINT_S:.0f} s)")
    print(f"{'day':>4}{'runs':>6}{'|share/w-1|':>13}{'FIFO':>7}{'prod wait':>11}{'FIFO':>9}{'p90':>6}"
          f"{'preempt':>9}{'overruns':>10}{'yield ih':>10}{'kill ih':>9}{'idle ih':>9}")
    for d in days:
        print(f"{d['seed']:>4}{d['runs']:>6}{d['share_error']:>13.3f}{d['fifo_share_error']:>7.3f}"
              f"{d['production_median_wait_s']:>10.0f}s{d['fifo_production_median_wait_s']:>8.0f}s"
              f"{d['production_p90_wait_s']:>5.0f}s{d['preemptions']:>9}{d['overruns']:>10}"
              f"{d['yield_instance_hours']:>10.1f}{d['kill_instance_hours']:>9.1f}"
              f"{d['idle_while_waiting_instance_hours']:>9.1f}")
    print("share: a team's share of the day's instance-hours over its weight's share (the worst team); prod wait: "
          "production runs' median wait to admission; yield ih: instance-hours spent stopping at a step and "
          "checkpointing for preemptions (no work redone); kill ih: what killing them back to their last "
          f"{PERIODIC_CHECKPOINT_S / 60:.0f}-minute checkpoint would have redone")
    worst = max(d["share_error"] for d in days)
    figures = [
        limit_figure("worst team's |share / weight - 1| on the worst day", [worst], 0.10, unit="fraction"),
        ratio_figure("worst team's |share / weight - 1| against FIFO", [d["share_error"] for d in days],
                     [d["fifo_share_error"] for d in days], unit="fraction", baseline_name="one FIFO queue",
                     better="lower"),
        limit_figure("production runs' median wait (each day)", [max(d["production_median_wait_s"] for d in days)],
                     bound, unit="s"),
        ratio_figure("production runs' median wait against FIFO",
                     [max(d["production_median_wait_s"], 1.0) for d in days],
                     [max(d["fifo_production_median_wait_s"], 1.0) for d in days], unit="s",
                     baseline_name="one FIFO queue", better="lower"),
        difference_figure("moments over quota", [float(d["overruns"]) for d in days], [0.0] * len(days),
                          unit="moments", baseline_name="none allowed", goal=0.0),
        ratio_figure("instance-hours lost to preemption against killing to the last checkpoint",
                     [max(d["yield_instance_hours"], 1e-6) for d in days],
                     [max(d["kill_instance_hours"], 1e-6) for d in days], unit="instance-hours",
                     baseline_name="kill and resume from the last periodic checkpoint", better="lower"),
    ]
    emit("fleet", figures, teams=args.teams, instances=args.instances, step_s=STEP_S, checkpoint_s=CHECKPOINT_S,
         days=[{k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()} for d in days])


def _p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1] if len(values) >= 2 else values[0]


if __name__ == "__main__":
    main()
