"""Each rank's pace through its training steps: the stall limit that follows it, whom a rank that
waits in a step waits for, and which ranks are slower than their peers.

The progress watchdog ends a rank that makes no progress for `compute.hang_timeout_minutes`, a
limit long enough for a rank's start and its first step's compilation. Once an attempt has measured
a few steps, a hung step shows much sooner: `StepPace` holds the rank to `compute.hang_floor_seconds`
plus `compute.hang_step_factor` times its median step, and lets go as the loop ends. Evaluations and
checkpoints run `watchdog.busy`, so the tight limit counts the steps alone.

A rank held up in a step's collective by a peer that never came cannot tell that from its own hang.
So each rank posts how far it got (the step it began, and once its own work in it is done; after a
rollback, the rollbacks it made) to the launcher's key-value store (torchrun's TCPStore at
MASTER_ADDR:MASTER_PORT, on a connection of its own), and a rank whose limit passes names the peers
that got less far: whichever rank's watchdog fires first, the report names who held the run up. (On
a lazy device, xla or neuron, a rank's own work is traced by then and runs at the step's syncs.)

A slow rank holds every step up as long as it takes, so step times alone cannot tell it: a rank's
own work (forward and backward, before the replicas average their gradients) can. At each logged
step the ranks share their median own work over the steps since the last comparison (at least
`SLOW_WINDOW` of them); a rank over its peers' median by `compute.slow_rank_factor` is named
(`SlowRank`), as a suspect host.
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
SLOW_WINDOW = 5
"""The fewest steps a rank's own work is averaged over before it is compared with its peers': a
window of one or two steps says more of the host's scheduling than of the rank."""
STORE_TIMEOUT = timedelta(seconds=10)


class StepPace:
    """This rank's step times and where it is: `begun(step, rows)` as a step starts (past the point an
    injected fault strikes), `reached()` once its own work in the step is done (before the replicas
    average their gradients), `ended(seconds, own)` as the step ends, `rewound()` after a rollback,
    `compare(step)` at a logged step (on every rank), `close()` when the loop ends."""

    def __init__(self, ctx: WorkerContext, factor: float | None, floor: float, slow_factor: float | None = None):
        self.ctx, self.factor, self.floor, self.slow_factor = ctx, factor, floor, slow_factor
        self.own: list[float] = []  # this window's own work, step by step
        self.slow: dict[int, SlowRank] = {}  # by rank: its slowest window
        self.window_steps = 0  # the steps of the window `compare` last looked at
        self.times: deque[float] = deque(maxlen=WINDOW)
        self.first = True
        self.rows = 0  # the batch rows of the steps measured: a batch of another shape compiles anew
        self.position = (0, 0, 0)  # (rollbacks, step, own work done): how far this rank got
        self.host = watchdog.host_label()
        self.store = peer_store() if factor and ctx.world_size > 1 else None

    def begun(self, step: int, rows: int = 0) -> None:
        if rows and self.rows and rows != self.rows:  # its graphs may compile in the step: the run's limit
            watchdog.pace(None)
        self._post((self.position[0], step, 0))

    def reached(self) -> None:
        self._post((self.position[0], self.position[1], 1))

    def rewound(self) -> None:
        self._post((self.position[0] + 1, 0, 0))

    def _post(self, position: tuple[int, int, int]) -> None:
        self.position = position
        if self.store is not None:
            try:
                self.store.set(str(self.ctx.rank), json.dumps({"at": position, "core": self.ctx.core_id,
                                                                "host": self.host}))
            except RuntimeError as exc:  # the store went away: peers are named no more, the limit holds
                self.ctx.log("pace", store=f"unreachable ({str(exc).splitlines()[0][:200]})")
                self.store = None

    def ended(self, seconds: float, own: float = 0.0, rows: int = 0) -> None:
        if self.first:  # an attempt's first step loads or compiles its graphs
            self.first = False
            return
        self.times.append(seconds)
        self.own.append(own)
        self.rows = self.rows or rows
        if self.factor and len(self.times) >= MEASURED:
            median = statistics.median(self.times)
            watchdog.pace(watchdog.Pace(
                self.floor + self.factor * median,
                f"{self.factor:g} x its median step of {median:.2f} s + {self.floor:g} s: compute.hang_step_factor, "
                "compute.hang_floor_seconds", self.behind))

    def close(self) -> None:
        watchdog.pace(None)

    def compare(self, step: int) -> list[SlowRank]:
        """The ranks slow over the window that ends at logged step `step`, once it holds `SLOW_WINDOW`
        steps (else the window goes on to the next logged step); a collective: every rank calls it, has
        measured as many steps, and gets the same answer. Each is kept at its slowest window in `slow`."""
        if self.ctx.world_size == 1 or not self.slow_factor or len(self.own) < SLOW_WINDOW:
            return []
        mine = statistics.median(self.own)  # a step slow on every rank (an attempt's second, here) is no outlier
        self.window_steps, self.own = len(self.own), []
        heard = gather_objects(self.ctx, (mine, self.ctx.core_id, self.host))
        found = slow_ranks(heard, self.slow_factor, step)
        for s in found:
            if s.rank not in self.slow or s.ratio > self.slow[s.rank].ratio:
                self.slow[s.rank] = s
        return found

    def behind(self) -> tuple[int, list[watchdog.Peer]]:
        """The step this rank is in, and the peers that got less far in it (not begun, or their own
        work not done) as the store last heard: none when the store cannot say."""
        return self.position[1], self._behind()

    def _behind(self) -> list[watchdog.Peer]:
        if self.store is None:
            return []
        peers = []
        try:
            for rank in range(self.ctx.world_size):
                if rank == self.ctx.rank:
                    continue
                if not self.store.check([str(rank)]):
                    if self.position > (0, 0, 0):
                        peers.append(watchdog.Peer(rank, None, "its host", "had not begun a step of this attempt"))
                    continue
                heard = json.loads(self.store.get(str(rank)))
                at = tuple(heard["at"])
                if at < self.position:
                    where = ("had not begun a step since the rollback" if at[1] == 0 else
                             f"last began step {at[1]}" if at[:2] < self.position[:2] else
                             f"began step {at[1]} but never finished its own work in it")
                    peers.append(watchdog.Peer(rank, heard["core"], heard["host"], where))
        except (RuntimeError, ValueError, KeyError, TypeError):
            return []
        return peers


def slow_ranks(heard: list[tuple[float | None, int, str]], factor: float, step: int) -> list[SlowRank]:
    """The ranks whose median own work (`heard[rank]`: seconds, core, host) is over `factor` times
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
