"""Each rank's progress watchdog: a rank that makes no progress for `compute.hang_timeout_minutes`
is ended as stalled, naming itself and its host, instead of holding its instances until the
service's attempt timeout (a day, by default).

Progress is any beat: a training step, an inference shard, a collective, a compiled program, a
batch of rows read, or a log event. A stalled rank (a host that stopped answering, a device that
never returns) cannot beat, so a thread of its own notices, writes the rank's failure report
(`Stalled`, transient: the stage is retried and resumes from its checkpoint) and ends the process.
The launcher then stops the node's other ranks, and the job ends with the node.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from trnflow.errors import ExitCode

_lock = threading.Lock()
_last: tuple[float, str] = (time.monotonic(), "started")
_started = False
_busy = 0


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


def stalled_message(rank: int, core: int, host: str, seconds: float, label: str) -> str:
    return (f"rank {rank} (NeuronCore {core}) on {host} made no progress for {seconds / 60:.1f} min "
            f"(compute.hang_timeout_minutes); its last progress was: {label}. The host or its device stopped "
            f"answering: the stage is retried and resumes from its last checkpoint")


def start(limit_seconds: float, on_stall: Callable[[float, str], None]) -> None:
    """Watch this process: once no beat came for `limit_seconds`, call `on_stall(seconds, label)`
    (which writes the rank's failure report), then end the process with the failure exit code."""
    global _started
    with _lock:
        if _started:
            return
        _started = True
    beat("started")
    poll = min(5.0, max(0.05, limit_seconds / 10))

    def watch() -> None:
        while True:
            time.sleep(poll)
            since, label = _last
            idle = time.monotonic() - since
            if idle > limit_seconds and not _busy:
                try:
                    on_stall(idle, label)
                finally:
                    sys.stderr.flush()
                    os._exit(ExitCode.FAILED)

    threading.Thread(target=watch, name="progress-watchdog", daemon=True).start()
