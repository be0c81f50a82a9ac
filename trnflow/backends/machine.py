"""This machine's queue of runs: which run holds which NeuronCores, which wait, and why.

A run on the local backend enters the queue before its first job and holds its cores from its first
stage to its last (`MachineQueue.enter`, `Ticket`): another run's job never takes them between two
stages, and a run that finds them taken waits here, at the run's level, with its reason in words,
instead of spending its stages' retries. Who goes first is `admission.decide`'s to say, as for the
fleet; a run asked to yield (`YieldRequest`) checkpoints at its next step boundary and queues again.

The queue is files in the runtime directory (`queue/`), shared by whoever shares the cores:

    lock          flocked while a run reads the queue and decides: one decision at a time
    <run>.json    a run's entry (`QueueEntry`), flocked by its run's process while it waits or holds:
                  an entry whose lock is free is a dead process's, and is dropped (the operating
                  system frees the lock however the process ended, SIGKILL included)
    <run>.yield   a request that the run yield its cores (`YieldRequest`), written by the run it yields to
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trnflow.backends.admission import Claim, Decision, Pool, Share, decide
from trnflow.errors import FatalError, TransientError
from trnflow.fsutil import atomic_write_text
from trnflow.neuron.launch import aligned_ranges, format_cores
from trnflow.neuron.runtime import runtime_dir
from trnflow.teams import LOCAL_QUOTA, Team

POOL_NAME = "this machine"
POLL_SECONDS = 1.0
"""How often a waiting run looks at the queue again."""


class QueueEntry(BaseModel):
    """A run in this machine's queue, as its own process keeps it."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(description="The run.")
    label: str = Field(description="How others name it (`run r1 (flow run 'quick-fox')`).")
    team: str = Field(description="Its team.")
    shares: dict[str, dict] = Field(default_factory=dict, description="Each team's share of this machine as its "
                                    "process knows them (`admission.Share`'s fields: quota in cores, weight, "
                                    "borrow, lend): its own team's, and every team its teams file declares.")
    priority_class: str = Field(description="Its priority class.")
    priority: int = Field(description="The class's place in the order (higher first).")
    cores_needed: int = Field(description="How many NeuronCores it holds while admitted.")
    total_cores: int = Field(description="The cores of the instance it emulates (the pool's size).")
    arrived: float = Field(description="When it first entered the queue (epoch seconds; kept when it is preempted).")
    preemptions: int = Field(0, description="How often it has yielded so far.")
    preemptible: bool = Field(True, description="Whether it can still yield at a step boundary (not past training).")
    state: Literal["waiting", "holding"] = Field("waiting", description="Whether it waits or holds its cores.")
    cores: list[int] = Field(default_factory=list, description="The cores it holds (holding).")
    admitted: float | None = Field(None, description="When it was last admitted (epoch seconds).")
    reason: str = Field("", description="Why it waits, as last decided.")
    place: int | None = Field(None, description="Its place in the queue's order when last decided (0: next).")
    expected_s: float | None = Field(None, description="How long it is forecast to take once admitted (`trnflow "
                                     "plan`'s total); None when it has no forecast.")
    pid: int = Field(description="Its orchestrating process.")
    host: str = Field(description="The host of that process.")

    def claim(self) -> Claim:
        since = self.admitted if self.state == "holding" and self.admitted is not None else self.arrived
        return Claim(self.run_id, self.team, self.cores_needed, self.priority, self.priority_class, since,
                     self.preemptions, label=self.label, preemptible=self.preemptible)

    def charged(self, now: float) -> float:
        """Core-seconds its run will still hold, by its forecast: its team's usage, for fair share."""
        if self.state != "holding" or self.expected_s is None:
            return 0.0
        return self.cores_needed * max(0.0, (self.admitted or now) + self.expected_s - now)


class YieldRequest(BaseModel):
    """A request that a run give up its cores at its next step boundary."""

    model_config = ConfigDict(extra="forbid")

    to: str = Field(description="The run it yields to.")
    label: str = Field(description="That run, as others name it.")
    priority_class: str = Field(description="That run's class.")
    asked: float = Field(description="When (epoch seconds).")


def queue_dir() -> Path:
    path = runtime_dir() / "queue"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _live(path: Path) -> QueueEntry | None:
    """The entry at `path` if its process still holds it; a dead process's entry is removed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held: its run is alive
            text = os.pread(fd, 1 << 20, 0).decode()
            try:
                return QueueEntry.model_validate_json(text)
            except ValidationError:
                return None  # written by another version of trnflow, or being written: not ours to judge
        for stale in (path, path.with_suffix(".yield")):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _deciding() -> Iterator[None]:
    """The queue's lock: entries are written and read whole under it (never nested in one process)."""
    fd = os.open(queue_dir() / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _entries() -> list[QueueEntry]:
    return [e for p in sorted(queue_dir().glob("*.json")) if (e := _live(p)) is not None]


def entries() -> list[QueueEntry]:
    """Every live run in this machine's queue, waiting or holding."""
    with _deciding():
        return _entries()


def reserved(excluding: str | None = None, found: list[QueueEntry] | None = None) -> dict[int, str]:
    """The cores runs hold (core: run id), but `excluding`'s; of `found` (read now when None)."""
    found = entries() if found is None else found
    return {core: e.run_id for e in found if e.state == "holding" and e.run_id != excluding for core in e.cores}


def held_by(run_id: str, found: list[QueueEntry] | None = None) -> list[int] | None:
    """The cores `run_id` holds, or None when it holds none (it is not admitted on this machine)."""
    found = entries() if found is None else found
    return next((e.cores for e in found if e.run_id == run_id and e.state == "holding"), None)


def pool_of(found: list[QueueEntry]) -> Pool:
    """This machine as a pool: its cores (the most any entry's instance has), each team's share as
    the entries carry them."""
    shares = {team: Share(**share) for e in found for team, share in e.shares.items()}
    return Pool(POOL_NAME, "core", max(e.total_cores for e in found), shares)


def usage_of(found: list[QueueEntry], now: float) -> dict[str, float]:
    """Each team's usage for fair share: what its runs holding will still use, by their forecasts."""
    usage: dict[str, float] = {}
    for e in found:
        usage[e.team] = usage.get(e.team, 0.0) + e.charged(now)
    return usage


class Ticket:
    """A run's place in the queue, held by its process until `release`."""

    def __init__(self, entry: QueueEntry, busy: Callable[[list[int]], bool]):
        self.entry = entry
        self._busy = busy
        self.path = queue_dir() / f"{entry.run_id}.json"
        with _deciding():  # never between another process's look at a free entry and its removal of it
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._write()
            except BlockingIOError:
                os.close(self._fd)
                raise TransientError(f"run {entry.run_id} is in this machine's queue already, from another "
                                     "process: one process orchestrates a run at a time") from None
            except BaseException:
                os.close(self._fd)
                raise

    def _write(self) -> None:
        data = self.entry.model_dump_json().encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    @property
    def cores(self) -> list[int]:
        return list(self.entry.cores)

    def look(self) -> Decision:
        """One look at the queue: admitted when the decision says so and cores are free to place it on;
        otherwise its reason and place are brought up to date. Runs the decision asks to yield are
        asked (`YieldRequest`)."""
        with _deciding():
            found = [e for e in _entries() if e.run_id != self.entry.run_id] + [self.entry]
            holding = [e for e in found if e.state == "holding"]
            waiting = [e for e in found if e.state == "waiting"]
            asked = {e.run_id: r.to for e in holding if (r := _asked(e.run_id, found)) is not None}
            claims = [replace(e.claim(), yielding=asked.get(e.run_id)) for e in holding]
            decision = decide(pool_of(found), claims, [e.claim() for e in waiting], usage_of(found, time.time()))
            for victim, to in decision.preempt.items():
                if to == self.entry.run_id and victim not in asked:
                    request = YieldRequest(to=to, label=self.entry.label, priority_class=self.entry.priority_class,
                                           asked=time.time())
                    atomic_write_text(queue_dir() / f"{victim}.yield", request.model_dump_json())
            verdict = decision.verdicts.get(self.entry.run_id)
            if self.entry.state == "waiting" and verdict is not None:
                cores, why = self._place(holding) if verdict.admitted else (None, verdict.reason)
                if cores is not None:
                    self.entry = self.entry.model_copy(update={"state": "holding", "cores": cores, "reason": "",
                                                               "admitted": time.time(), "place": None})
                else:
                    self.entry = self.entry.model_copy(update={"reason": why, "place": verdict.place})
                self._write()
            return decision

    def _place(self, holding: list[QueueEntry]) -> tuple[list[int] | None, str]:
        """Cores for this run: the first aligned range no other run holds, one no process uses first."""
        taken = frozenset(c for e in holding for c in e.cores)
        try:
            ranges = aligned_ranges(self.entry.cores_needed, self.entry.total_cores, taken)
        except FatalError:  # no whole range free: the cores others hold are scattered across them
            return None, (f"no {self.entry.cores_needed} aligned free cores among nc0-nc"
                          f"{self.entry.total_cores - 1} (runs hold {format_cores(sorted(taken))})")
        return self._unused(ranges), ""

    def _unused(self, ranges: list[list[int]]) -> list[int]:
        """The first of `ranges` that no process uses (a job outside any run), else the first."""
        return next((r for r in ranges if not self._busy(r)), ranges[0])

    def wait(self, on_wait: Callable[[str], None], poll_seconds: float = POLL_SECONDS) -> list[int]:
        """Look until admitted; `on_wait` hears each new reason. The cores it holds."""
        said = None
        while True:
            self.look()
            if self.entry.state == "holding":
                return self.cores
            if self.entry.reason != said:
                said = self.entry.reason
                on_wait(said)
            time.sleep(poll_seconds)

    def asked_to_yield(self) -> YieldRequest | None:
        """The request that this run yield, while the run that asked still waits for it."""
        if self.entry.state != "holding" or not self.entry.preemptible:
            return None
        if yield_request(self.entry.run_id) is None:  # the usual answer, without the queue's lock
            return None
        with _deciding():
            return _asked(self.entry.run_id, _entries())

    def past_yielding(self) -> None:
        """The run is past its training: it can no longer yield at a step boundary, so it is never
        asked (a request made before now is dropped)."""
        with _deciding():
            self.entry = self.entry.model_copy(update={"preemptible": False})
            self._write()
            with contextlib.suppress(FileNotFoundError):
                (queue_dir() / f"{self.entry.run_id}.yield").unlink()

    def requeue(self) -> None:
        """After yielding: back in the queue, at its first arrival, one preemption more."""
        with _deciding():
            self.entry = self.entry.model_copy(update={"state": "waiting", "cores": [], "admitted": None,
                                                       "preemptions": self.entry.preemptions + 1})
            self._write()
            with contextlib.suppress(FileNotFoundError):
                (queue_dir() / f"{self.entry.run_id}.yield").unlink()

    def move(self, exclude: frozenset[int]) -> list[int]:
        """Hold other cores instead, avoiding `exclude` (cores found bad): the first aligned range no
        other run holds. FatalError when the instance has no such range at all; TransientError when
        other runs hold them now."""
        healthy = aligned_ranges(self.entry.cores_needed, self.entry.total_cores, exclude)  # else FatalError
        with _deciding():
            taken = {c for e in _entries() if e.state == "holding" and e.run_id != self.entry.run_id for c in e.cores}
            ranges = [r for r in healthy if not taken.intersection(r)]
            if not ranges:
                raise TransientError(f"run {self.entry.run_id} cannot move off NeuronCore(s) "
                                     f"{format_cores(sorted(exclude))} now: other runs hold the other healthy cores "
                                     f"({format_cores(sorted(taken))})")
            cores = self._unused(ranges)
            self.entry = self.entry.model_copy(update={"cores": cores})
            self._write()
            return cores

    def release(self) -> None:
        """Leave the queue: the cores are free for the next run."""
        with _deciding():
            for path in (self.path, self.path.with_suffix(".yield")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            os.close(self._fd)
        _TICKETS.pop(self.entry.run_id, None)


def _asked(run_id: str, found: list[QueueEntry]) -> YieldRequest | None:
    """`run_id`'s yield request, if the run that made it still waits for it; a request whose asker
    has gone (ended, admitted otherwise, dead) is dropped. Called under the queue's lock."""
    request = yield_request(run_id)
    if request is None:
        return None
    if any(e.run_id == request.to and e.state == "waiting" for e in found):
        return request
    with contextlib.suppress(FileNotFoundError):
        (queue_dir() / f"{run_id}.yield").unlink()
    return None


def yield_request(run_id: str) -> YieldRequest | None:
    path = queue_dir() / f"{run_id}.yield"
    try:
        return YieldRequest.model_validate_json(path.read_text())
    except (FileNotFoundError, ValidationError):
        return None


_TICKETS: dict[str, Ticket] = {}
"""This process's tickets, by run id: its jobs' backend moves a run off bad cores through them."""


def ticket(run_id: str) -> Ticket | None:
    """The ticket this process holds for `run_id`."""
    return _TICKETS.get(run_id)


def share_of(team: Team) -> dict:
    """A team's share of this machine, as an entry carries it."""
    return Share(quota=team.quota(LOCAL_QUOTA), weight=team.weight, borrow=team.borrow, lend=team.lend).__dict__


def entry_for(run_id: str, label: str, team: Team, priority_class: str, priority: int, cores_needed: int,
              total_cores: int, expected_s: float | None = None, teams: list[Team] = (),
              preemptible: bool = True) -> QueueEntry:
    """A run's entry as it enters the queue now (waiting); `teams`: every team its teams file declares."""
    shares = {t.name: share_of(t) for t in (*teams, team)}
    return QueueEntry(run_id=run_id, label=label, team=team.name, shares=shares, priority_class=priority_class,
                      priority=priority, cores_needed=cores_needed, total_cores=total_cores, arrived=time.time(),
                      expected_s=expected_s, preemptible=preemptible, pid=os.getpid(), host=socket.gethostname())


def expected_wait(newcomer: QueueEntry, found: list[QueueEntry] | None = None,
                  now: float | None = None) -> tuple[float | None, str]:
    """How long `newcomer`, entering the queue now, would wait for its cores: the queue played
    forward through `decide`, each run ahead taking its forecast (`expected_s`) once admitted. None,
    with the reason, when a run ahead has no forecast. Preemptions are not played: a higher class
    that would preempt waits here as if it did not."""
    now = time.time() if now is None else now
    found = entries() if found is None else found
    ends = {e.run_id: (e.admitted or now) + (e.expected_s or 0.0) for e in found if e.state == "holding"}
    waiting = {e.run_id: e for e in found if e.state == "waiting"} | {newcomer.run_id: newcomer}
    holding = {e.run_id: e for e in found if e.state == "holding"}
    unknown = [e.label for e in found if e.expected_s is None]
    clock = now
    while True:
        everyone = [*holding.values(), *waiting.values()]
        decision = decide(pool_of(everyone), [e.claim() for e in holding.values()],
                          [e.claim() for e in waiting.values()], usage_of(everyone, clock))
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


def enter(run_id: str, label: str, team: Team, priority_class: str, priority: int, cores_needed: int,
          total_cores: int, busy: Callable[[list[int]], bool], expected_s: float | None = None,
          teams: list[Team] = (), preemptible: bool = True) -> Ticket:
    """Put the run in this machine's queue (waiting): `Ticket.wait` admits it."""
    entry = entry_for(run_id, label, team, priority_class, priority, cores_needed, total_cores, expected_s, teams,
                      preemptible)
    held = Ticket(entry, busy)
    _TICKETS[run_id] = held
    return held
