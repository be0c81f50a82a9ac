"""Exclusive NeuronCore ownership, as the Neuron runtime enforces it: one process per core.

Each emulated core is a lock file in the runtime directory. A process owns a core while it holds
an exclusive `flock` on that file, so the operating system releases the core when the process
dies, even by SIGKILL: no PID file can go stale. The file's content names the holder, for error
messages and `trnflow devices`.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from trnflow.errors import FatalError, TransientError
from trnflow.neuron.launch import aligned_ranges, format_cores
from trnflow.neuron.runtime import RT_DIR_ENV, runtime_dir

__all__ = ["RT_DIR_ENV", "CoreLease", "CoresUnavailable", "acquire", "allocate", "holder", "holders", "runtime_dir"]


class CoresUnavailable(TransientError):
    """The requested cores are held by another process. Transient: the holder may finish or die."""


def _lock_path(core: int) -> Path:
    return runtime_dir() / f"nc{core}.lock"


def holder(core: int) -> dict | None:
    """The process holding `core` ({"pid", "command", "since"}), or None when it is free."""
    path = _lock_path(core)
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return json.loads(path.read_text() or "{}") or {"pid": None, "command": "?"}
            except json.JSONDecodeError:  # the holder is writing its record right now
                return {"pid": None, "command": "?"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def holders(total: int) -> dict[int, dict]:
    """Every held core among 0..total-1, with its holder."""
    return {core: h for core in range(total) if (h := holder(core)) is not None}


@dataclass
class CoreLease:
    cores: list[int]
    _fds: list[int] = field(default_factory=list, repr=False)

    def release(self) -> None:
        for fd in self._fds:
            os.close(fd)  # closing the descriptor drops the flock
        self._fds.clear()


def acquire(cores: list[int], total: int, command: str, attempts: int = 3) -> CoreLease:
    """Hold `cores` exclusively or fail at once, naming the holder, in the runtime's words."""
    if any(c < 0 or c >= total for c in cores):
        raise FatalError(f"NeuronCore(s) {format_cores(cores)} do not exist: this instance has nc0-nc{total - 1}")
    lease = CoreLease(list(cores))
    record = json.dumps({"pid": os.getpid(), "command": command, "since": round(time.time(), 3)})
    for core in cores:
        fd = os.open(_lock_path(core), os.O_RDWR | os.O_CREAT, 0o644)
        for attempt in range(attempts):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt + 1 < attempts:
                    time.sleep(0.02)  # a `trnflow devices` probe holds a shared lock for microseconds
        else:
            os.close(fd)
            lease.release()
            raise unavailable(cores, total)
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        lease._fds.append(fd)
    return lease


def held_text(held: dict[int, dict]) -> str:
    """`nc0 held by pid 12 (trnflow.workload compile rank 0 of run r1); ...`"""
    return "; ".join(f"nc{core} held by pid {h.get('pid')} ({h.get('command', '?')})" for core, h in held.items())


def unavailable(requested: list[int], total: int) -> CoresUnavailable:
    held = holders(total)
    owners = held_text({core: h for core, h in held.items() if core in requested})
    return CoresUnavailable(
        f"ERROR  NRT:nrt_allocate_neuron_cores  NeuronCore(s) not available - "
        f"Requested:{format_cores(requested)} Available:{total - len(held)}. {owners}. "
        "Wait for that process to finish, stop it, or run on other cores (NEURON_RT_VISIBLE_CORES)"
    )


def allocate(count: int, total: int, exclude: frozenset[int] = frozenset()) -> list[int]:
    """A free, contiguous range of `count` cores starting at a multiple of `count` (the runtime's
    placement rule for collective jobs), avoiding `exclude`; the first such range wins."""
    healthy = aligned_ranges(count, total, exclude)
    held = holders(total)
    for cores in healthy:
        if not held.keys() & set(cores):
            return cores
    raise unavailable(healthy[0], total)
