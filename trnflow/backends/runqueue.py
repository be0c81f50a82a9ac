"""A queue of runs for one pool of capacity: which runs hold it, which wait, and why.

Two queues share this logic and differ only in where their entries live and how a run takes what
it is given:
- this machine's NeuronCores (`trnflow.backends.machine`): files in the runtime directory, a run
  admitted is placed on cores of its own;
- the stack's instances of one type, for cloud runs (`trnflow.backends.stack_queue`): Variables and
  global concurrency limits on the Prefect server, a run admitted takes slots of the limits.

A run enters before its first job and holds its place from its first stage to its last (`Ticket`).
Who goes first is `admission.decide`'s to say; a run asked to yield (`YieldRequest`) checkpoints at
its next step boundary, gives back what it holds and queues again at its first arrival.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from trnflow.backends.admission import Claim, Decision, Pool, Share, decide
from trnflow.teams import Team

POLL_SECONDS = 1.0
"""How often a waiting run looks at the queue again."""


class QueueEntry(BaseModel):
    """A run in a queue, as its own process keeps it."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(description="The run.")
    label: str = Field(description="How others name it (`run r1 (flow run 'quick-fox')`).")
    team: str = Field(description="Its team.")
    shares: dict[str, dict] = Field(default_factory=dict, description="Each team's share of the pool as its "
                                    "process knows them (`admission.Share`'s fields: quota in units, weight, "
                                    "borrow, lend): its own team's, and every team its teams file declares.")
    priority_class: str = Field(description="Its priority class.")
    priority: int = Field(description="The class's place in the order (higher first).")
    pool: str = Field(description="The pool it waits for, as reasons name it (`this machine`, `trn1.32xlarge`).")
    unit: Literal["core", "instance"] = Field(description="What the pool is counted in.")
    units: int = Field(description="How many units it holds while admitted (NeuronCores, or instances).")
    capacity: int = Field(description="The pool's size in units, as its process knows it.")
    arrived: float = Field(description="When it first entered the queue (epoch seconds; kept when it is preempted).")
    preemptions: int = Field(0, description="How often it has yielded so far.")
    preemptible: bool = Field(True, description="Whether it can still yield at a step boundary (not past training).")
    state: Literal["waiting", "holding"] = Field("waiting", description="Whether it waits or holds its units.")
    cores: list[int] = Field(default_factory=list, description="This machine's queue: the cores it holds.")
    admitted: float | None = Field(None, description="When it was last admitted (epoch seconds).")
    reason: str = Field("", description="Why it waits, as last decided.")
    place: int | None = Field(None, description="Its place in the queue's order when last decided (0: next).")
    expected_s: float | None = Field(None, description="How long it is forecast to take once admitted (`trnflow "
                                     "plan`'s total); None when it has no forecast.")
    cost_usd: float | None = Field(None, description="What it is forecast to cost (US dollars): its team's daily "
                                   "spend while it holds; None when it has no forecast.")
    pid: int = Field(description="Its orchestrating process.")
    host: str = Field(description="The host of that process.")
    beat: float | None = Field(None, description="The stack's queue: when its process last said it is alive "
                               "(epoch seconds); an entry silent for long is a dead process's, and is dropped.")

    def claim(self) -> Claim:
        since = self.admitted if self.state == "holding" and self.admitted is not None else self.arrived
        return Claim(self.run_id, self.team, self.units, self.priority, self.priority_class, since,
                     self.preemptions, label=self.label, preemptible=self.preemptible, cost=self.cost_usd or 0.0)

    def charged(self, now: float) -> float:
        """Unit-seconds its run will still hold, by its forecast: its team's usage, for fair share."""
        if self.state != "holding" or self.expected_s is None:
            return 0.0
        return self.units * max(0.0, (self.admitted or now) + self.expected_s - now)


class YieldRequest(BaseModel):
    """A request that a run give up what it holds at its next step boundary."""

    model_config = ConfigDict(extra="forbid")

    to: str = Field(description="The run it yields to.")
    label: str = Field(description="That run, as others name it.")
    priority_class: str = Field(description="That run's class.")
    asked: float = Field(description="When (epoch seconds).")


class Spend(BaseModel):
    """What each team's runs that ended on one day cost."""

    model_config = ConfigDict(extra="forbid")

    teams: dict[str, float] = Field(default_factory=dict, description="US dollars, by team.")


class QueueStore(Protocol):
    """Where a queue's entries and yield requests live."""

    def deciding(self) -> AbstractContextManager[None]:
        """The queue's lock: one decision at a time, entries written and read whole under it."""

    def entries(self) -> list[QueueEntry]:
        """Every live entry (a dead process's are dropped). Under `deciding`."""

    def request(self, run_id: str) -> YieldRequest | None:
        """The request that `run_id` yield, if any."""

    def ask(self, run_id: str, request: YieldRequest) -> None:
        """Ask `run_id` to yield."""

    def drop_request(self, run_id: str) -> None:
        """Forget the request that `run_id` yield."""

    def spent(self, day: str) -> dict[str, float]:
        """What each team's runs that ended on `day` (UTC, YYYY-MM-DD) cost, in US dollars. Under `deciding`."""

    def add_spend(self, team: str, day: str, usd: float) -> None:
        """Add what a run of `team` that ended on `day` cost. Under `deciding`."""


def today() -> str:
    """The day spend is counted in: UTC."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def share_of(team: Team, key: str) -> dict:
    """A team's share of a pool (`key`: an instance type, or `local`), as an entry carries it."""
    return Share(quota=team.quota(key), weight=team.weight, borrow=team.borrow, lend=team.lend,
                 daily_spend=team.daily_spend_usd).__dict__


def entry_for(run_id: str, label: str, team: Team, priority_class: str, priority: int, units: int, capacity: int,
              pool: str, unit: Literal["core", "instance"], quota_key: str, expected_s: float | None = None,
              teams: list[Team] = (), preemptible: bool = True, cost_usd: float | None = None) -> QueueEntry:
    """A run's entry as it enters a queue now (waiting); `teams`: every team its teams file declares."""
    shares = {t.name: share_of(t, quota_key) for t in (*teams, team)}
    now = time.time()
    return QueueEntry(run_id=run_id, label=label, team=team.name, shares=shares, priority_class=priority_class,
                      priority=priority, pool=pool, unit=unit, units=units, capacity=capacity, arrived=now,
                      expected_s=expected_s, cost_usd=cost_usd, preemptible=preemptible, pid=os.getpid(),
                      host=socket.gethostname(), beat=now)


def pool_of(found: list[QueueEntry], known: dict[str, dict] | None = None) -> Pool:
    """The entries' pool: its size (the most any entry knows), each team's share as the entries carry
    them and, over those, as `known` (the deciding process's teams file) says."""
    shares = {team: Share(**share) for e in found for team, share in {**e.shares, **(known or {})}.items()}
    return Pool(found[0].pool, found[0].unit, max(e.capacity for e in found), shares)


def usage_of(found: list[QueueEntry], now: float) -> dict[str, float]:
    """Each team's usage for fair share: what its runs holding will still use, by their forecasts."""
    usage: dict[str, float] = {}
    for e in found:
        usage[e.team] = usage.get(e.team, 0.0) + e.charged(now)
    return usage


def ordered(found: list[QueueEntry]) -> list[QueueEntry]:
    """Pool by pool: holders first (the earliest admitted first), then waiting runs in their turn."""
    listed = []
    for pool in sorted({e.pool for e in found}):
        holding = sorted((e for e in found if e.pool == pool and e.state == "holding"), key=lambda e: e.admitted or 0.0)
        waiting = sorted((e for e in found if e.pool == pool and e.state == "waiting"),
                         key=lambda e: (e.place is None, e.place or 0, -e.priority, e.arrived))
        listed += holding + waiting
    return listed


def spent_elsewhere(found: list[QueueEntry], pool: str, recorded: dict[str, float]) -> dict[str, float]:
    """Each team's spend today as a decision over `pool` counts it: what its ended runs cost
    (`recorded`), and the forecasts of its runs holding other pools (this pool's holders are the
    decision's to count)."""
    spent = dict(recorded)
    for e in found:
        if e.pool != pool and e.state == "holding" and e.cost_usd:
            spent[e.team] = spent.get(e.team, 0.0) + e.cost_usd
    return spent


class Ticket:
    """A run's place in a queue, held by its process until `release`. Subclasses say how the entry
    is kept (`_write`, `_remove`) and how an admitted run takes and gives back its units."""

    poll_seconds = POLL_SECONDS
    """How often a waiting run looks at the queue again."""

    def __init__(self, entry: QueueEntry, store: QueueStore):
        self.entry = entry
        self.store = store
        self.shares = dict(entry.shares)
        """Every team's share as this process's teams file says (an entry may carry its own team's only)."""
        self._forecast_cost = entry.cost_usd
        self._recorded = 0.0
        """What this run's spend so far has put in its team's day (a run that yielded is counted then)."""

    def _write(self) -> None:
        raise NotImplementedError

    def _remove(self) -> None:
        """Remove the run's entry. Under the queue's lock."""
        raise NotImplementedError

    def _close(self) -> None:
        """Let go of what keeps the entry alive (its lock, its heartbeat), however `release` went."""

    def _take(self, holding: list[QueueEntry]) -> tuple[list[int] | None, str]:
        """Take the units the decision admits it to: the cores it is placed on ([] where units are not
        cores), or None with why it cannot take them yet. Under the queue's lock."""
        raise NotImplementedError

    def _give_back(self) -> None:
        """Let go of the units it holds (after yielding, or at its end)."""

    @property
    def cores(self) -> list[int]:
        return list(self.entry.cores)

    def _update(self, **fields) -> None:
        self.entry = self.entry.model_copy(update=fields)
        self._write()

    def look(self) -> Decision:
        """One look at the queue: admitted when the decision says so and its units can be taken;
        otherwise its reason and place are brought up to date. Runs the decision asks to yield are
        asked (`YieldRequest`)."""
        with self.store.deciding():
            everyone = [e for e in self.store.entries() if e.run_id != self.entry.run_id]
            found = [e for e in everyone if e.pool == self.entry.pool] + [self.entry]  # one pool per decision
            holding = [e for e in found if e.state == "holding"]
            waiting = [e for e in found if e.state == "waiting"]
            asked = {e.run_id: r.to for e in holding if (r := _asked(self.store, e.run_id, found)) is not None}
            claims = [replace(e.claim(), yielding=asked.get(e.run_id)) for e in holding]
            spent = spent_elsewhere(everyone, self.entry.pool, self.store.spent(today()))
            decision = decide(pool_of(found, self.shares), claims, [e.claim() for e in waiting],
                              usage_of(found, time.time()), spent=spent)
            for victim, to in decision.preempt.items():
                if to == self.entry.run_id and victim not in asked:
                    self.store.ask(victim, YieldRequest(to=to, label=self.entry.label, asked=time.time(),
                                                        priority_class=self.entry.priority_class))
            verdict = decision.verdicts.get(self.entry.run_id)
            if self.entry.state == "waiting" and verdict is not None:
                cores, why = self._take(holding) if verdict.admitted else (None, verdict.reason)
                if cores is not None:
                    self._update(state="holding", cores=cores, reason="", admitted=time.time(), place=None)
                else:
                    self._update(reason=why, place=verdict.place)
            return decision

    def wait(self, on_wait: Callable[[str], None], poll_seconds: float | None = None) -> list[int]:
        """Look until admitted; `on_wait` hears each new reason. The cores it holds ([] in the cloud)."""
        said = None
        while True:
            self.look()
            if self.entry.state == "holding":
                return self.cores
            if self.entry.reason != said:
                said = self.entry.reason
                on_wait(said)
            time.sleep(self.poll_seconds if poll_seconds is None else poll_seconds)

    def asked_to_yield(self) -> YieldRequest | None:
        """The request that this run yield, while the run that asked still waits for it."""
        if self.entry.state != "holding" or not self.entry.preemptible:
            return None
        if self.store.request(self.entry.run_id) is None:  # the usual answer, without the queue's lock
            return None
        with self.store.deciding():
            return _asked(self.store, self.entry.run_id, self.store.entries())

    def past_yielding(self) -> None:
        """The run is past its training: it can no longer yield at a step boundary, so it is never
        asked (a request made before now is dropped)."""
        with self.store.deciding():
            self._update(preemptible=False)
            self.store.drop_request(self.entry.run_id)

    def _spend(self, cost_usd: float | None) -> None:
        """Put what the run has cost so far (`cost_usd`, its whole cost table) in its team's day, less
        what was put there before. Under the queue's lock."""
        more = (cost_usd or 0.0) - self._recorded
        if more > 0:
            self.store.add_spend(self.entry.team, today(), more)
            self._recorded += more

    def requeue(self, cost_usd: float | None = None) -> None:
        """After yielding: back in the queue, at its first arrival, one preemption more. `cost_usd`:
        what the run has cost so far, in its team's spend now (its forecast holds only what is left)."""
        with self.store.deciding():
            self._give_back()
            self._spend(cost_usd)
            left = None if self._forecast_cost is None else max(0.0, self._forecast_cost - self._recorded)
            self._update(state="waiting", cores=[], admitted=None, preemptions=self.entry.preemptions + 1,
                         cost_usd=left)
            self.store.drop_request(self.entry.run_id)

    def release(self, cost_usd: float | None = None) -> None:
        """Leave the queue: what it held is free for the next run, whatever fails on the way.
        `cost_usd`: what the run cost, in its team's spend today."""
        try:
            with self.store.deciding():
                self._spend(cost_usd)
                self._remove()
                self.store.drop_request(self.entry.run_id)
        finally:
            self._give_back()
            self._close()


def _asked(store: QueueStore, run_id: str, found: list[QueueEntry]) -> YieldRequest | None:
    """`run_id`'s yield request, if the run that made it still waits for it; a request whose asker
    has gone (ended, admitted otherwise, dead) is dropped. Under the queue's lock."""
    request = store.request(run_id)
    if request is None:
        return None
    if any(e.run_id == request.to and e.state == "waiting" for e in found):
        return request
    store.drop_request(run_id)
    return None


def expected_wait(newcomer: QueueEntry, found: list[QueueEntry], now: float | None = None,
                  spent: dict[str, float] | None = None) -> tuple[float | None, str]:
    """How long `newcomer`, entering the queue now, would wait: the queue played forward through
    `decide`, each run ahead taking its forecast (`expected_s`) once admitted. None, with the reason,
    when a run ahead has no forecast. `spent`: each team's spend today (a run its team's daily
    spend stops waits for good here: the next day is not played). Preemptions are not played: a
    higher class that would preempt waits here as if it did not."""
    now = time.time() if now is None else now
    ends = {e.run_id: (e.admitted or now) + (e.expected_s or 0.0) for e in found if e.state == "holding"}
    waiting = {e.run_id: e for e in found if e.state == "waiting"} | {newcomer.run_id: newcomer}
    holding = {e.run_id: e for e in found if e.state == "holding"}
    unknown = [e.label for e in found if e.expected_s is None]
    clock = now
    while True:
        everyone = [*holding.values(), *waiting.values()]
        decision = decide(pool_of(everyone, newcomer.shares), [e.claim() for e in holding.values()],
                          [e.claim() for e in waiting.values()], usage_of(everyone, clock), spent=spent)
        for run_id in decision.admitted:
            admitted = waiting.pop(run_id)
            if run_id == newcomer.run_id:
                if unknown:
                    return None, f"{', '.join(unknown)} ha{'s' if len(unknown) == 1 else 've'} no forecast"
                return clock - now, ""
            holding[run_id] = admitted.model_copy(update={"state": "holding", "admitted": clock})
            ends[run_id] = clock + (admitted.expected_s or 0.0)
        if not holding:  # nothing will end: it can never be admitted here
            return None, decision.verdicts[newcomer.run_id].reason
        clock = max(clock, min(ends[r] for r in holding))
        for run_id in [r for r in holding if ends[r] <= clock]:
            del holding[run_id]
