"""Admission: which runs may take capacity now, which wait and why, and which are asked to yield.

One pure decision over a snapshot of one pool. The machine's queue (`trnflow.backends.machine`) and
the fleet simulation (`benchmarks/fleet.py`) both take it from `decide`, so what a laptop does with
its cores is what a fleet does with its instances.

A pool is capacity of one kind: the instances of one type, or one machine's NeuronCores. Each team
has a quota in it (none: the whole pool). A team that may borrow takes what lending teams leave
idle (and their own waiting runs do not want), and what no quota assigns; a lender takes it back by
preemption when it needs it. Waiting runs go in order: the higher priority first, then the team
furthest below its fair share (its usage over its weight), then the earliest arrival. A run that
cannot go holds up the runs behind it (of its team, when its team's quota stops it; all but runs
within their own team's quota, when the pool is full), so a large run is never starved by small
ones slipping past it.

Preemption asks holders to yield at their next step boundary (they checkpoint and queue again):
- a team's own lower-priority runs, for its higher-priority run that its quota or the pool stops;
- runs on borrowed capacity, for a run of the lender within its quota.
Another team's runs within their own quota are never preempted, whatever their class. A run
preempted `max_preemptions` times is not asked again for a higher class of its team; capacity it
borrowed always goes back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

MAX_PREEMPTIONS = 3
"""How many times one run may be asked to yield; after that it keeps what it holds until it ends."""


@dataclass(frozen=True)
class Share:
    """A team's part of a pool."""

    quota: int | None = None
    """Units it may hold of its own (None: the whole pool)."""
    weight: float = 1.0
    """Its fair share against other teams' weights, when they wait in one class."""
    borrow: bool = False
    """Whether it may hold more than its quota, from what lending teams leave idle."""
    lend: bool = True
    """Whether what it leaves idle of its quota may be lent (it takes it back by preemption)."""
    daily_spend: float | None = None
    """US dollars its runs may spend in a day (None: no limit): spent, plus the forecasts of its runs holding."""


@dataclass(frozen=True)
class Claim:
    """A run that holds units of the pool, or waits for them."""

    run_id: str
    team: str
    units: int
    priority: int = 0
    priority_class: str = ""
    since: float = 0.0
    """Waiting: when it first entered the queue (kept when it is preempted). Holding: when admitted."""
    preemptions: int = 0
    yielding: str | None = None
    """A holder asked to yield: the run it yields to (it still holds its units until it has ended)."""
    label: str = ""
    """How reasons name it (`run r1 (flow run 'quick-fox')`); `run <id>` when empty."""
    preemptible: bool = True
    """A holder that can still yield at a step boundary (one past its training cannot)."""
    cost: float = 0.0
    """What the run is forecast to cost, in US dollars (0: unknown): its team's daily spend, once admitted."""

    @property
    def named(self) -> str:
        return self.label or f"run {self.run_id}"


@dataclass(frozen=True)
class Pool:
    """Capacity of one kind, and each team's share of it."""

    name: str
    """As a reason names it: `trn1.32xlarge`, `this machine`."""
    unit: str
    """`instance`, `core`."""
    capacity: int
    shares: Mapping[str, Share] = field(default_factory=dict)
    """Per team; a team not listed has no quota (the whole pool) and weight 1."""

    def share(self, team: str) -> Share:
        return self.shares.get(team, Share())

    def quota(self, team: str) -> int:
        """Units the team may hold without borrowing (its quota, or the whole pool)."""
        quota = self.share(team).quota
        return self.capacity if quota is None else quota

    def limits(self, team: str) -> bool:
        """Whether the team has a quota here (one without is stopped only by a full pool)."""
        return self.share(team).quota is not None

    def units(self, n: int) -> str:
        return f"{n} {self.unit}{'' if n == 1 else 's'}"


@dataclass(frozen=True)
class Verdict:
    """What became of one waiting run."""

    run_id: str
    admitted: bool
    place: int
    """Its place in the queue's order (0: first)."""
    reason: str = ""
    """Why it waits, in one line (`team a at its trn1.32xlarge quota, 4 of 4 instances; 1 run ahead`)."""
    borrowed: int = 0
    """Units above its team's quota that it holds once admitted."""


@dataclass(frozen=True)
class Decision:
    verdicts: dict[str, Verdict]
    """Each waiting run's, by run id."""
    preempt: dict[str, str]
    """Holders to ask to yield now, each with the run it yields to."""

    @property
    def admitted(self) -> list[str]:
        return [v.run_id for v in self.verdicts.values() if v.admitted]


def order(pool: Pool, waiting: Iterable[Claim], usage: Mapping[str, float] | None = None) -> list[Claim]:
    """The queue's order: priority, then fair share (usage over weight, lowest first), then arrival."""
    usage = usage or {}
    return sorted(waiting, key=lambda c: (-c.priority, usage.get(c.team, 0.0) / max(pool.share(c.team).weight, 1e-9),
                                          c.since, c.run_id))


class _Tally:
    """Units held, in all and per team."""

    def __init__(self, pool: Pool, held: Iterable[Claim], wanted: Mapping[str, int] | None = None):
        self.pool = pool
        self.wanted = wanted or {}
        """Per team, units its own waiting runs want: idle quota they want is not lent."""
        self.team: dict[str, int] = {}
        for h in held:
            self.team[h.team] = self.team.get(h.team, 0) + h.units
        self.total = sum(self.team.values())

    def used(self, team: str) -> int:
        return self.team.get(team, 0)

    def borrowed(self, team: str, extra: int = 0) -> int:
        return max(0, self.used(team) + extra - self.pool.quota(team))

    def lendable(self, borrower: str) -> int:
        """Units other teams' quotas leave idle (and their own waiting runs do not want) and lend, and
        what no quota assigns."""
        pool, declared = self.pool, [t for t, s in self.pool.shares.items() if s.quota is not None]
        idle = sum(max(0, pool.quota(t) - self.used(t) - self.wanted.get(t, 0)) for t in declared
                   if t != borrower and pool.share(t).lend)
        return idle + max(0, pool.capacity - sum(pool.quota(t) for t in declared))

    def within_quota(self, claim: Claim) -> bool:
        return self.used(claim.team) + claim.units <= self.pool.quota(claim.team)

    def may_borrow(self, claim: Claim) -> bool:
        others = sum(self.borrowed(t) for t in self.team if t != claim.team)
        return self.pool.share(claim.team).borrow and others + self.borrowed(claim.team, claim.units) <= \
            self.lendable(claim.team)

    def fits(self, claim: Claim) -> bool:
        """Whether `claim` may go now: room in the pool, and in its quota or what it may borrow."""
        room = claim.units <= self.pool.capacity - self.total
        return room and (self.within_quota(claim) or self.may_borrow(claim))


def _victims(pool: Pool, after: list[Claim], waiter: Claim, over: bool, max_preemptions: int,
             holders: set[str], wanted: Mapping[str, int]) -> list[Claim]:
    """The fewest holders whose yielding lets `waiter` in: those yielding to it already first, then
    the lowest class, then the newest; empty when no such set exists. `after`: what will be held
    once the runs asked so far have yielded. Its team's own lower-priority runs (but one preempted
    `max_preemptions` times) and, unless it is `over` its quota (it would borrow), runs on capacity
    borrowed from others' quotas (whatever their class or count); never one that cannot yield, one
    yielding to another run, nor one admitted in this decision (not among `holders`)."""
    tally = _Tally(pool, after, wanted)
    lent = {t: tally.borrowed(t) for t in tally.team if t != waiter.team}
    candidates = []
    for h in sorted(after, key=lambda c: (c.yielding != waiter.run_id, c.priority, -c.since)):
        if h.run_id not in holders or h.yielding not in (None, waiter.run_id) or not h.preemptible:
            continue
        if h.team == waiter.team and h.priority < waiter.priority and (
                h.yielding is not None or h.preemptions < max_preemptions):
            candidates.append(h)
        elif not over and h.team != waiter.team and lent.get(h.team, 0) > 0:
            candidates.append(h)
            lent[h.team] -= h.units
    chosen: list[Claim] = []
    for h in candidates:
        chosen.append(h)
        if _Tally(pool, [c for c in after if c not in chosen], wanted).fits(waiter):
            break
    else:
        return []
    for h in [c for c in chosen if c.yielding is None]:  # none asked that the others make needless
        if _Tally(pool, [c for c in after if c not in chosen or c is h], wanted).fits(waiter):
            chosen.remove(h)
    return chosen


def _never(pool: Pool, claim: Claim) -> str | None:
    """Why `claim` can never be admitted here, whatever ends: more than the pool, or more than its
    quota and all it could ever borrow."""
    if claim.units > pool.capacity:
        return f"needs {pool.units(claim.units)}, more than {pool.name} has ({pool.units(pool.capacity)})"
    limit = pool.share(claim.team).daily_spend
    if limit is not None and claim.cost > limit:
        return (f"is forecast to cost ${claim.cost:.2f}, more than team {claim.team}'s daily spend limit "
                f"(${limit:.2f})")
    if not pool.limits(claim.team):
        return None
    share, others = pool.share(claim.team), [t for t in pool.shares if t != claim.team and pool.limits(t)]
    most = pool.quota(claim.team)
    if share.borrow:
        most += pool.capacity - sum(pool.quota(t) for t in (claim.team, *others))  # no one's
        most += sum(pool.quota(t) for t in others if pool.share(t).lend)
    if claim.units > most:
        return (f"needs {pool.units(claim.units)}, more than team {claim.team} may ever hold of {pool.name} "
                f"({pool.units(most)}: its quota{' and all it could borrow' if share.borrow else ''})")
    return None


def _totals(claims: Iterable[Claim], start: Mapping[str, float] | None, what: Callable[[Claim], float]) -> dict:
    """Per team, `start` (nothing when None) plus `what` (its units, or its cost) of its `claims`."""
    totals = dict(start or {})
    for claim in claims:
        totals[claim.team] = totals.get(claim.team, 0) + what(claim)
    return totals


def _over_spend(pool: Pool, claim: Claim, used: float) -> str | None:
    """Why `claim` would take its team past its daily spend limit, `used` being what its runs spent
    or hold today; None within it. Only time frees it."""
    limit = pool.share(claim.team).daily_spend
    if limit is None or used + claim.cost <= limit:
        return None
    return (f"team {claim.team} at its daily spend limit, ${used:.2f} of ${limit:.2f} spent or forecast today "
            f"(this run: ${claim.cost:.2f})")


def _stopped_by(pool: Pool, claim: Claim, held: list[Claim], later: _Tally) -> tuple[str, bool, bool]:
    """Why `claim` does not fit now, in words; whether its team's quota stops it (`later`: the pool
    once the runs already asked have yielded); and whether only that does (its team may not borrow,
    so only its own runs stand in its way)."""
    over = bool(pool.limits(claim.team)) and not later.within_quota(claim)
    by_quota = over and not pool.share(claim.team).borrow
    if not over:
        return f"{pool.name} is full, {_Tally(pool, held).total} of {pool.units(pool.capacity)} held", False, False
    quota = pool.quota(claim.team)
    reason = f"team {claim.team} at its {pool.name} quota, {later.used(claim.team)} of {pool.units(quota)}"
    return reason + ("" if by_quota else ", and no idle quota to borrow"), over, by_quota


def decide(pool: Pool, holding: Iterable[Claim], waiting: Iterable[Claim], usage: Mapping[str, float] | None = None,
           max_preemptions: int = MAX_PREEMPTIONS, spent: Mapping[str, float] | None = None) -> Decision:
    """Who of `waiting` goes now, who waits and why, and which holders are asked to yield. `spent`:
    per team, what its runs that ended today cost (US dollars); with its holders' forecasts, and the
    waiter's, it must stay within the team's `daily_spend`, or the waiter waits (nobody yields for it).

    A waiter some holders yield to keeps its place: the units it will have are counted as taken for
    the waiters behind it, who may still go on what is left or ask their own victims to yield. A
    waiter nobody yields to holds up those behind it: of its team, when its team's quota stops it;
    else all of them but runs within their team's quota, which is theirs whoever waits before
    them. A run that can never be admitted holds up nobody."""
    held = list(holding)
    holders = {h.run_id for h in held}
    promised: list[Claim] = []  # waiters that holders yield to: their units are spoken for
    spoken: set[str] = set()  # the holders yielding to them
    verdicts: dict[str, Verdict] = {}
    preempt: dict[str, str] = {}
    full_behind: Claim | None = None  # the first run the full pool stopped: everyone behind it waits
    team_behind: dict[str, Claim] = {}  # per team, the first run its quota stopped
    queue = order(pool, waiting, usage)
    spend, wanted = _totals(held, spent, lambda c: c.cost), _totals(queue, None, lambda c: c.units)
    for place, claim in enumerate(queue):
        ahead = f"{place} run{'' if place == 1 else 's'} ahead"
        if (never := _never(pool, claim)) is not None:
            verdicts[claim.run_id] = Verdict(claim.run_id, False, place, never)
            continue
        tally = _Tally(pool, held + promised, wanted)  # held now, and spoken for: admission never counts on a yield
        own = pool.limits(claim.team) and tally.within_quota(claim)
        first = team_behind.get(claim.team) or (None if own else full_behind)  # a team's quota is its own
        if first is not None:
            verdicts[claim.run_id] = Verdict(claim.run_id, False, place, f"behind {first.named}; {ahead}")
            continue
        if (spending := _over_spend(pool, claim, spend.get(claim.team, 0.0))) is not None:  # nobody yields for it
            verdicts[claim.run_id] = Verdict(claim.run_id, False, place, f"{spending}; {ahead}")
            team_behind[claim.team] = claim
            continue
        if tally.fits(claim):
            borrowed = tally.borrowed(claim.team, claim.units) - tally.borrowed(claim.team)
            verdicts[claim.run_id] = Verdict(claim.run_id, True, place, borrowed=borrowed)
            spend[claim.team] = spend.get(claim.team, 0.0) + claim.cost
            held.append(claim)
            wanted[claim.team] -= claim.units
            continue
        after = [h for h in held if h.run_id not in spoken] + promised  # once the runs asked have yielded
        reason, over, by_quota = _stopped_by(pool, claim, held, _Tally(pool, after, wanted))
        victims = _victims(pool, after, claim, over, max_preemptions, holders, wanted)
        for v in victims:
            if v.yielding is None:
                preempt[v.run_id] = claim.run_id
        if victims:
            names = ", ".join(f"{v.named} ({v.priority_class or f'priority {v.priority}'})" for v in victims)
            reason += f"; {names} yielding to it at a checkpoint"
            promised.append(claim)
            spoken |= {v.run_id for v in victims}
        elif by_quota:
            team_behind[claim.team] = claim
        else:
            full_behind = claim
        verdicts[claim.run_id] = Verdict(claim.run_id, False, place, f"{reason}; {ahead}")
    return Decision(verdicts, preempt)
