"""The stack's queue of cloud runs: which runs hold the stack's instances of one type, which wait, and why.

A cloud run whose instance type is limited (a team's quota, or the stack's capacity) enters this
queue before its first job and holds its instances from its first stage to its last, as a run on
one machine holds its cores (`runqueue`, the same decision). Every orchestrator of the stack shares
it through the Prefect server they share (PREFECT_API_URL), in Prefect's own primitives:

    global concurrency limit trnflow-queue       1 slot: the queue's lock, one decision at a time
                                                 (leased: a decider that dies frees it within a minute)
    global concurrency limit trnflow-<type>      the stack's capacity of the type: a slot per instance
                                                 held, leased by the run's process while it holds them
    global concurrency limit trnflow-<team>-<type>
                                                 the team's quota of the type (its pool's capacity when
                                                 it may borrow): a slot per instance its runs hold
    variable trnflow-queue-<run id>              a run's entry (`QueueEntry`), its heartbeat renewed by
                                                 its process; an entry silent for `STALE_SECONDS` is a
                                                 dead process's, and is dropped
    variable trnflow-yield-<run id>              a request that the run yield (`YieldRequest`)

The Prefect UI shows what each team and type holds (Concurrency), the entries (Variables), and each
waiting run's reason in its flow run's state. The limits' slots hold what `admission.decide`
admits: a run admitted takes its slots or is not admitted, so a limit is never exceeded whatever
the queue's entries say; quotas that borrowing may pass, fair share and preemption are the
decision's. This room keeps the queue's logic; the Prefect calls are the flows room's
(`trnflow.flows._queue`, a `StackStore`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from trnflow.backends.runqueue import QueueEntry, QueueStore, Ticket, entry_for
from trnflow.errors import TransientError
from trnflow.specs import JobSpec
from trnflow.teams import Team, Teams

BEAT_SECONDS = 15.0
"""How often a run's process renews its entry's heartbeat."""
STALE_SECONDS = 90.0
"""An entry whose heartbeat is older than this is a dead process's."""
LEASE_SECONDS = 60.0
"""The leases of the lock and of a run's slots (Prefect's shortest): renewed while their process lives."""
POLL_SECONDS = 5.0
"""How often a waiting cloud run looks at the queue again."""


def pool_limit(instance_type: str) -> str:
    return f"trnflow-{instance_type}"


def team_limit(team: str, instance_type: str) -> str:
    return f"trnflow-{team}-{instance_type}"


def capacity_of(teams: Teams, instance_type: str) -> int | None:
    """The stack's capacity of `instance_type` (instances at once): the teams file's `capacity`, else
    the sum of its teams' quotas when every team has one; None when nothing limits it."""
    if instance_type in teams.capacity:
        return teams.capacity[instance_type]
    quotas = [t.quota(instance_type) for t in teams.teams]
    return None if any(q is None for q in quotas) else sum(quotas)


class StackStore(QueueStore, Protocol):
    """The stack's queue's store: `QueueStore`, each run's entry, and the limits' slots."""

    def put(self, entry: QueueEntry) -> None:
        """Write `entry` (its run's process alone writes it)."""

    def forget(self, run_id: str) -> None:
        """Remove `run_id`'s entry."""

    def ensure_limit(self, name: str, limit: int) -> None:
        """Limit `name` exists, of `limit` slots."""

    def hold(self, names: list[str], slots: int) -> Callable[[], None] | None:
        """Take `slots` of each limit in `names`, leased until the function returned is called (which
        gives them back); None when they cannot be taken now."""


class StackTicket(Ticket):
    """A cloud run's place in the stack's queue: its entry, its heartbeat, and while admitted the
    slots of its type's and its team's limits, leased until `release`."""

    poll_seconds = POLL_SECONDS

    def __init__(self, entry: QueueEntry, team_slots: int, store: StackStore):
        super().__init__(entry, store)
        self.server = store
        self._mutex = threading.RLock()  # the heartbeat writes the entry too: one change at a time
        self._held: Callable[[], None] | None = None
        self._limits = [pool_limit(entry.pool), team_limit(entry.team, entry.pool)]
        store.ensure_limit(self._limits[0], entry.capacity)
        store.ensure_limit(self._limits[1], team_slots)
        with store.deciding():
            there = next((e for e in store.entries() if e.run_id == entry.run_id), None)
            if there is not None and not _dead_here(there):
                raise TransientError(f"run {entry.run_id} is in the stack's queue already, from process {there.pid} "
                                     f"on {there.host}: one process orchestrates a run at a time (an entry whose "
                                     f"process died is dropped {STALE_SECONDS:.0f} s after its last heartbeat)")
            self._write()
        self._stop = threading.Event()
        self._beating = threading.Thread(target=self._beat, name=f"trnflow-queue-{entry.run_id}", daemon=True)
        self._beating.start()

    def _write(self) -> None:
        with self._mutex:
            self.entry = self.entry.model_copy(update={"beat": time.time()})
            self.server.put(self.entry)

    def _update(self, **fields) -> None:
        with self._mutex:
            super()._update(**fields)

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            with contextlib.suppress(Exception):  # a beat missed is tried again; one silent STALE_SECONDS is dropped
                self._write()

    def _remove(self) -> None:
        self._close()
        self.server.forget(self.entry.run_id)

    def _close(self) -> None:
        self._stop.set()
        if self._beating.is_alive() and self._beating is not threading.current_thread():
            self._beating.join()
        _TICKETS.pop(self.entry.run_id, None)

    def _take(self, holding: list[QueueEntry]) -> tuple[list[int] | None, str]:
        """The slots of its type's and its team's limits, one per instance, leased while it holds them."""
        held = self.server.hold(self._limits, self.entry.units)
        if held is None:
            return None, (f"the {self.entry.pool} slots are still leased by a run that has ended (its lease "
                          f"lapses within {LEASE_SECONDS:.0f} s)")
        self._held = held
        return [], ""

    def _give_back(self) -> None:
        if self._held is not None:
            give_back, self._held = self._held, None
            give_back()


def _dead_here(entry: QueueEntry) -> bool:
    """Whether `entry`'s process ran on this host and has ended (a rerun of its run takes its place)."""
    if entry.host != socket.gethostname():
        return False
    try:
        os.kill(entry.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's live process
        return False
    return False


_TICKETS: dict[str, StackTicket] = {}


def ticket(run_id: str) -> StackTicket | None:
    """The ticket this process holds for `run_id` in the stack's queue."""
    return _TICKETS.get(run_id)


UNLIMITED = 1_000_000
"""The capacity of a type nothing but teams' daily spend limits."""


def limited(spec: JobSpec, teams: Teams | None) -> int | None:
    """The stack's capacity of the spec's instance type when a cloud run of it must queue (its
    teams file limits the type, or a team's daily spend); None when nothing does."""
    if spec.compute.backend == "local" or teams is None:
        return None
    capacity = capacity_of(teams, spec.compute.instance_type)
    if capacity is None and any(t.daily_spend_usd is not None for t in teams.teams):
        return UNLIMITED
    return capacity


def newcomer(spec: JobSpec, run_id: str, label: str, team: Team, priority_class: str, priority: int,
             capacity: int, expected_s: float | None = None, teams: list[Team] = (),
             preemptible: bool = True, cost_usd: float | None = None) -> QueueEntry:
    """A cloud run's entry as it enters the stack's queue now (waiting)."""
    kind = spec.compute.instance_type
    return entry_for(run_id, label, team, priority_class, priority, spec.compute.nodes, capacity, kind, "instance",
                     kind, expected_s, teams, preemptible, cost_usd)


def enter(entry: QueueEntry, team: Team, store: StackStore) -> StackTicket:
    """Put the run in the stack's queue (waiting): `Ticket.wait` admits it."""
    quota = team.quota(entry.pool)
    slots = entry.capacity if quota is None or team.borrow else min(quota, entry.capacity)
    held = StackTicket(entry, slots, store)
    _TICKETS[entry.run_id] = held
    return held
