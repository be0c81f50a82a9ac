"""This machine's queue of runs: which run holds which NeuronCores, which wait, and why.

A run on the local backend enters the queue before its first job and holds its cores from its first
stage to its last (`enter`, `MachineTicket`): another run's job never takes them between two
stages, and a run that finds them taken waits here, at the run's level, with its reason in words,
instead of spending its stages' retries. The queue's logic is `runqueue`'s, as for the stack's
instances; this module keeps its entries in files and places each run admitted on cores of its own.

The queue is files in the runtime directory (`queue/`), shared by whoever shares the cores:

    lock          flocked while a run reads the queue and decides: one decision at a time
    <run>.json    a run's entry (`QueueEntry`), flocked by its run's process while it waits or holds:
                  an entry whose lock is free is a dead process's, and is dropped (the operating
                  system frees the lock however the process ended, SIGKILL included)
    <run>.yield   a request that the run yield its cores (`YieldRequest`), written by the run it yields to
    spend-<day>.day
                  what each team's runs that ended that day (UTC) cost (`Spend`)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from pydantic import ValidationError

from trnflow.backends.runqueue import QueueEntry, Spend, Ticket, YieldRequest, entry_for, expected_wait
from trnflow.errors import FatalError, TransientError
from trnflow.fsutil import atomic_write_text
from trnflow.neuron.launch import aligned_ranges, format_cores
from trnflow.neuron.runtime import runtime_dir
from trnflow.teams import LOCAL_QUOTA, Team

__all__ = ["MachineTicket", "QueueEntry", "YieldRequest", "enter", "entries", "expected_wait", "held_by",
           "newcomer", "queue_dir", "reserved", "ticket", "yield_request"]

POOL_NAME = "this machine"


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


class _Files:
    """The queue's store: files in `queue_dir()`."""

    @contextlib.contextmanager
    def deciding(self) -> Iterator[None]:
        """The queue's lock (never nested in one process)."""
        fd = os.open(queue_dir() / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def entries(self) -> list[QueueEntry]:
        return [e for p in sorted(queue_dir().glob("*.json")) if (e := _live(p)) is not None]

    def request(self, run_id: str) -> YieldRequest | None:
        return yield_request(run_id)

    def ask(self, run_id: str, request: YieldRequest) -> None:
        atomic_write_text(queue_dir() / f"{run_id}.yield", request.model_dump_json())

    def drop_request(self, run_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (queue_dir() / f"{run_id}.yield").unlink()

    def spent(self, day: str) -> dict[str, float]:
        try:
            return Spend.model_validate_json((queue_dir() / f"spend-{day}.day").read_text()).teams
        except (FileNotFoundError, ValidationError):
            return {}

    def add_spend(self, team: str, day: str, usd: float) -> None:
        teams = self.spent(day)
        teams[team] = teams.get(team, 0.0) + usd
        atomic_write_text(queue_dir() / f"spend-{day}.day", Spend(teams=teams).model_dump_json())
        for old in queue_dir().glob("spend-*.day"):  # earlier days count no more
            if old.name != f"spend-{day}.day":
                old.unlink(missing_ok=True)


FILES = _Files()


def entries() -> list[QueueEntry]:
    """Every live run in this machine's queue, waiting or holding."""
    with FILES.deciding():
        return FILES.entries()


def reserved(excluding: str | None = None, found: list[QueueEntry] | None = None) -> dict[int, str]:
    """The cores runs hold (core: run id), but `excluding`'s; of `found` (read now when None)."""
    found = entries() if found is None else found
    return {core: e.run_id for e in found if e.state == "holding" and e.run_id != excluding for core in e.cores}


def held_by(run_id: str, found: list[QueueEntry] | None = None) -> list[int] | None:
    """The cores `run_id` holds, or None when it holds none (it is not admitted on this machine)."""
    found = entries() if found is None else found
    return next((e.cores for e in found if e.run_id == run_id and e.state == "holding"), None)


class MachineTicket(Ticket):
    """A run's place in this machine's queue: its entry's file, flocked by its process until `release`."""

    def __init__(self, entry: QueueEntry, busy: Callable[[list[int]], bool]):
        super().__init__(entry, FILES)
        self._busy = busy
        self.path = queue_dir() / f"{entry.run_id}.json"
        with FILES.deciding():  # never between another process's look at a free entry and its removal of it
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

    def _remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        _TICKETS.pop(self.entry.run_id, None)

    def _take(self, holding: list[QueueEntry]) -> tuple[list[int] | None, str]:
        """Cores for this run: the first aligned range no other run holds, one no process uses first."""
        taken = frozenset(c for e in holding for c in e.cores)
        try:
            ranges = aligned_ranges(self.entry.units, self.entry.capacity, taken)
        except FatalError:  # no whole range free: the cores others hold are scattered across them
            return None, (f"no {self.entry.units} aligned free cores among nc0-nc"
                          f"{self.entry.capacity - 1} (runs hold {format_cores(sorted(taken))})")
        return self._unused(ranges), ""

    def _unused(self, ranges: list[list[int]]) -> list[int]:
        """The first of `ranges` that no process uses (a job outside any run), else the first."""
        return next((r for r in ranges if not self._busy(r)), ranges[0])

    def move(self, exclude: frozenset[int]) -> list[int]:
        """Hold other cores instead, avoiding `exclude` (cores found bad): the first aligned range no
        other run holds. FatalError when the instance has no such range at all; TransientError when
        other runs hold them now."""
        healthy = aligned_ranges(self.entry.units, self.entry.capacity, exclude)  # else FatalError
        with FILES.deciding():
            taken = {c for e in FILES.entries() if e.state == "holding" and e.run_id != self.entry.run_id
                     for c in e.cores}
            ranges = [r for r in healthy if not taken.intersection(r)]
            if not ranges:
                raise TransientError(f"run {self.entry.run_id} cannot move off NeuronCore(s) "
                                     f"{format_cores(sorted(exclude))} now: other runs hold the other healthy cores "
                                     f"({format_cores(sorted(taken))})")
            cores = self._unused(ranges)
            self._update(cores=cores)
            return cores


def yield_request(run_id: str) -> YieldRequest | None:
    path = queue_dir() / f"{run_id}.yield"
    try:
        return YieldRequest.model_validate_json(path.read_text())
    except (FileNotFoundError, ValidationError):
        return None


_TICKETS: dict[str, MachineTicket] = {}
"""This process's tickets, by run id: its jobs' backend moves a run off bad cores through them."""


def ticket(run_id: str) -> MachineTicket | None:
    """The ticket this process holds for `run_id`."""
    return _TICKETS.get(run_id)


def newcomer(run_id: str, label: str, team: Team, priority_class: str, priority: int, cores: int, total: int,
             expected_s: float | None = None, teams: list[Team] = (), preemptible: bool = True,
             cost_usd: float | None = None) -> QueueEntry:
    """A run's entry as it enters this machine's queue now (waiting): `cores` of the `total` of
    the instance it emulates; `teams`: every team its teams file declares."""
    return entry_for(run_id, label, team, priority_class, priority, cores, total, POOL_NAME, "core", LOCAL_QUOTA,
                     expected_s, teams, preemptible, cost_usd)


def enter(run_id: str, label: str, team: Team, priority_class: str, priority: int, cores: int, total: int,
          busy: Callable[[list[int]], bool], expected_s: float | None = None, teams: list[Team] = (),
          preemptible: bool = True, cost_usd: float | None = None) -> MachineTicket:
    """Put the run in this machine's queue (waiting): `Ticket.wait` admits it."""
    held = MachineTicket(newcomer(run_id, label, team, priority_class, priority, cores, total, expected_s, teams,
                                  preemptible, cost_usd), busy)
    _TICKETS[run_id] = held
    return held
