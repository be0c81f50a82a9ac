"""Each rank's pace through its training steps: the stall limit that follows it, whom a rank that
waits in a step waits for, and which ranks are slower than their peers.

The progress watchdog ends a rank that makes no progress for `compute.hang_timeout_minutes`, a
limit long enough for a rank's start and its first step's compilation. Once an attempt has measured
a few steps, a hung step shows much sooner: `StepPace` holds the rank to `compute.hang_floor_seconds`
plus `compute.hang_step_factor` times its median step, and lets go as the loop ends. Evaluations and
checkpoints run `watchdog.busy`, so the tight limit counts the steps alone.

A rank held up in a step's collective by a peer that never came cannot tell that from its own hang.
So each rank posts the step it begins to the launcher's key-value store (torchrun's TCPStore at
MASTER_ADDR:MASTER_PORT, on a connection of its own), and a rank whose limit passes names the peers
that never began its step: whichever rank's watchdog fires first, the report names who held the run up.

A slow rank holds every step up as long as it takes, so step times alone cannot tell it: a rank's
own work (forward and backward, before the replicas average their gradients) can. At each logged
step the ranks share their mean own work over the steps since the one before; a rank over its
peers' median by `compute.slow_rank_factor` is named (`SlowRank`), as a suspect host.
"""

from __future__ import annotations

import json
import os
import statistics
from collections import deque
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trnflow.results import SlowRank
from trnflow.workload import watchdog
from trnflow.workload.context import WorkerContext, gather_objects

MEASURED = 3
"""Steps an attempt measures (after its first, which loads or compiles its graphs) before its pace holds."""
WINDOW = 50
"""The recent steps whose median sets the limit."""
STORE_TIMEOUT = timedelta(seconds=10)


class StepPace:
    """This rank's step times and the step it is in: `begun(step)` as a step starts (past the point an
    injected fault strikes), `ended(seconds, own)` as it ends, `compare(step)` at a logged step (on
    every rank), `close()` when the loop ends."""

    def __init__(self, ctx: WorkerContext, factor: float | None, floor: float, slow_factor: float | None = None):
        self.ctx, self.factor, self.floor, self.slow_factor = ctx, factor, floor, slow_factor
        self.own: list[float] = []  # this window's own work, step by step
        self.slow: dict[int, SlowRank] = {}  # by rank: its slowest window
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.first = True
        self.step = 0
        self.host = watchdog.host_label()
        self.store = peer_store() if factor and ctx.world_size > 1 else None

    def begun(self, step: int) -> None:
        self.step = step
        if self.store is not None:
            try:
                self.store.set(str(self.ctx.rank), json.dumps({"step": step, "core": self.ctx.core_id,
                                                                "host": self.host}))
            except RuntimeError as exc:  # the store went away: peers are named no more, the limit holds
                self.ctx.log("pace", store=f"unreachable ({str(exc).splitlines()[0][:200]})")
                self.store = None

    def ended(self, seconds: float, own: float = 0.0) -> None:
        if self.first:  # an attempt's first step loads or compiles its graphs
            self.first = False
            return
        self.times.append(seconds)
        self.own.append(own)
        if self.factor and len(self.times) >= MEASURED:
            median = statistics.median(self.times)
            watchdog.pace(watchdog.Pace(
                self.floor + self.factor * median,
                f"{self.factor:g} x its median step of {median:.2f} s + {self.floor:g} s: compute.hang_step_factor, "
                "compute.hang_floor_seconds", self.behind))

    def close(self) -> None:
        watchdog.pace(None)

    def compare(self, step: int) -> list[SlowRank]:
        """The ranks slow over the window that ends at logged step `step` (a collective: every rank
        calls it, and each gets the same answer); each is kept at its slowest window in `slow`."""
        if self.ctx.world_size == 1 or not self.slow_factor:
            return []
        mine = statistics.fmean(self.own) if self.own else None  # None: the window held only the first step
        self.own = []
        heard = gather_objects(self.ctx, (mine, self.ctx.core_id, self.host))
        found = slow_ranks(heard, self.slow_factor, step)
        for s in found:
            if s.rank not in self.slow or s.ratio > self.slow[s.rank].ratio:
                self.slow[s.rank] = s
        return found

    def behind(self) -> tuple[int, list[watchdog.Peer]]:
        """The step this rank is in, and the peers that have not begun it as the store last heard
        (none when the store cannot say)."""
        return self.step, self._behind()

    def _behind(self) -> list[watchdog.Peer]:
        if self.store is None:
            return []
        peers = []
        try:
            for rank in range(self.ctx.world_size):
                if not self.store.check([str(rank)]):  # never began a step of this attempt
                    peers.append(watchdog.Peer(rank, None, "its host", 0))
                    continue
                heard = json.loads(self.store.get(str(rank)))
                peers.append(watchdog.Peer(rank, heard["core"], heard["host"], heard["step"]))
        except (RuntimeError, ValueError, KeyError):
            return []
        return [p for p in peers if p.step < self.step]


def slow_ranks(heard: list[tuple[float | None, int, str]], factor: float, step: int) -> list[SlowRank]:
    """The ranks whose mean own work (`heard[rank]`: seconds, core, host) is over `factor` times
    the median of their peers'."""
    slow = []
    for rank, (own, core, host) in enumerate(heard):
        peers = [h[0] for r, h in enumerate(heard) if r != rank and h[0] is not None]
        if own is None or not peers:
            continue
        median = statistics.median(peers)
        if median > 0 and own > factor * median:
            slow.append(SlowRank(rank=rank, core=core, host=host, step=step, own_seconds=round(own, 5),
                                 peers_seconds=round(median, 5), ratio=round(own / median, 3)))
    return slow


def peer_store() -> Any:
    """The launcher's key-value store, under this attempt's prefix; None where there is none."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False)
    except RuntimeError:
        return None
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"trnflow/pace/{attempt}/", store)
