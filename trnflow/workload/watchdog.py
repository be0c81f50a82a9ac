"""Each rank's progress watchdog: a rank that makes no progress for `compute.hang_timeout_minutes`
is ended as stalled, naming itself and its host, instead of holding its instances until the
service's attempt timeout (a day, by default).

Progress is any beat: a training step, an inference shard, a collective, a compiled program, a
batch of rows read, or a log event. A stalled rank (a host that stopped answering, a device that
never returns) cannot beat, so a thread of its own notices, writes the rank's failure report
(`Stalled`, transient: the stage is retried and resumes from its checkpoint) and ends the process.
The launcher then stops the node's other ranks, and the job ends with the node.

While training steps keep a measured pace, the training loop sets a tighter limit (`pace`, made by
`workload/pace.py`): a few of its median steps plus a floor.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from trnflow.errors import ExitCode

BASE_LIMIT = "compute.hang_timeout_minutes"


@dataclass(frozen=True)
class Peer:
    """Another rank that got less far than this one, as the pace's store last heard of it: `where`
    it was (`last began step 7`)."""

    rank: int
    core: int | None
    host: str
    where: str


@dataclass(frozen=True)
class Pace:
    """A tighter stall limit than the run's, while training steps keep their pace: `limit` seconds
    without a beat, `why` that many (quoted in the report), and `behind()`: the step this rank is in
    and the peers that have not begun it (whom a rank waiting in that step's collectives waits for)."""

    limit: float
    why: str
    behind: Callable[[], tuple[int, list[Peer]]] = field(default=lambda: (0, []))


_lock = threading.Lock()
_last: tuple[float, str] = (time.monotonic(), "started")
_started = False
_busy = 0
_pace: Pace | None = None
_paced = threading.Event()  # wakes the watcher to look at once with a new limit


def pace(limit: Pace | None) -> None:
    """Hold this rank to `limit` from now on; None: back to the run's limit."""
    global _pace
    _pace = limit
    _paced.set()


def held() -> Pace | None:
    """The pace this rank is held to, if any."""
    return _pace


def beat(label: str) -> None:
    """Record progress: `label` says what the rank was doing (the stall report quotes the last one)."""
    global _last
    _last = (time.monotonic(), label)


@contextlib.contextmanager
def busy(label: str) -> Iterator[None]:
    """Work that goes on without beats while the block runs: a compiler in other processes, a
    checkpoint being written (and the peers waiting for it), an evaluation. It is not taken for a
    stall however long it takes; a hang inside it is left to the collective timeout and the
    service's."""
    global _busy
    beat(label)
    _busy += 1
    try:
        yield
    finally:
        _busy -= 1
        beat(f"{label}, done")


def host_label(env: dict[str, str] | None = None) -> str:
    """This host as the services name it: SageMaker's `algo-N`, Batch's node index, then the host name."""
    env = dict(os.environ) if env is None else env
    name = socket.gethostname()
    if env.get("SM_CURRENT_HOST"):
        return f"{env['SM_CURRENT_HOST']} ({name})"
    if env.get("AWS_BATCH_JOB_NODE_INDEX"):
        return f"Batch node {env['AWS_BATCH_JOB_NODE_INDEX']} ({name})"
    return name


def _span(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 120 else f"{seconds:.1f} s"


def stalled_message(rank: int, core: int, host: str, seconds: float, label: str, why: str = BASE_LIMIT,
                    behind: list[Peer] | None = None, step: int | None = None) -> str:
    """The report of a rank that made no progress for `seconds` (over the limit `why` names): about
    the peers `behind` it, when it waited for them in `step`, else about itself."""
    if behind:
        who = "; ".join(f"rank {p.rank}" + (f" (NeuronCore {p.core})" if p.core is not None else "") +
                        f" on {p.host}, which {p.where}" for p in behind)
        return (f"rank {rank} (NeuronCore {core}) on {host} waited {_span(seconds)} in training step {step} "
                f"({why}) for {who}; its last progress was: {label}. That host or its device stopped answering: "
                f"the stage is retried and resumes from its last checkpoint")
    return (f"rank {rank} (NeuronCore {core}) on {host} made no progress for {_span(seconds)} ({why}); its last "
            f"progress was: {label}. The host or its device stopped answering: the stage is retried and resumes "
            f"from its last checkpoint")


def start(limit_seconds: float, on_stall: Callable[[float, str, Pace | None], None]) -> None:
    """Watch this process: once no beat came for `limit_seconds` (or the `pace` set since, while it
    holds), call `on_stall(seconds, label, pace)` (which writes the rank's failure report), then end
    the process with the failure exit code. It looks a tenth of the limit in force apart."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    beat("started")

    def watch() -> None:
        while True:
            held = _pace
            limit = held.limit if held is not None else limit_seconds
            if _paced.wait(min(5.0, max(0.05, limit / 10))):
                _paced.clear()
                continue
            since, label = _last
            idle = time.monotonic() - since
            if idle > limit and not _busy and held is _pace:
                try:
                    on_stall(idle, label, held)
                finally:
                    sys.stderr.flush()
                    os._exit(ExitCode.FAILED)

    threading.Thread(target=watch, name="progress-watchdog", daemon=True).start()
