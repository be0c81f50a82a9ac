"""Loss spikes and non-finite losses (`train.on_divergence`), and the steps a run skips.

With `rollback`, `Divergence.why` finds a step whose loss is not finite, or is over
`train.spike_factor` times the median of the rank's last 20 losses (once it has 5), on any rank,
and every rank agrees on it (one all-reduce a step). The trainer then goes back to its newest
checkpoint, and the diverged step joins the steps whose batches are skipped. They are kept in
`rollbacks.json` beside the run's checkpoints (rank 0 writes it before any rank goes on), so an
attempt that resumes from before one skips it too; `train.skip_steps` skips steps from the start.
A skipped step trains on nothing (no forward, backward or optimizer step) and still counts, so the
checkpoints and the steps after it keep their numbers and their batches.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from trnflow.errors import FatalError
from trnflow.records import Rollback, RollbackLog, dump, read
from trnflow.storage.base import Store
from trnflow.workload.collectives import all_true
from trnflow.workload.context import WorkerContext, gather_objects

ROLLBACKS = "rollbacks.json"
HISTORY = 20
"""The recent losses whose median a spike is measured against."""
MIN_HISTORY = 5
"""Losses a rank has seen (in this attempt) before a spike can be told."""


class Divergence:
    """A run's rule for divergence and the steps it skips (`skips`)."""

    def __init__(self, ctx: WorkerContext, store: Store):
        tcfg = ctx.spec.train
        self.ctx, self.store = ctx, store
        self.rollback = tcfg.on_divergence == "rollback"
        self.factor, self.max_rollbacks = tcfg.spike_factor, tcfg.max_rollbacks
        try:
            self.log = read(RollbackLog, store.read(ROLLBACKS), f"{store.url}/{ROLLBACKS}")
        except FileNotFoundError:
            self.log = RollbackLog()
        self.skips = set(tcfg.skip_steps) | {r.step for r in self.log.rollbacks}
        self.losses: deque[float] = deque(maxlen=HISTORY)

    def why(self, loss: float) -> str | None:
        """Why the step whose loss on this rank is `loss` diverged, as every rank agrees (a
        collective); None when it did not."""
        mine = self._rule(loss)
        if mine is None:
            self.losses.append(loss)
        if self.ctx.world_size > 1 and all_true(mine is None):
            return None
        if self.ctx.world_size > 1:  # seldom: every rank hears each rank's reason
            return next(r for r in gather_objects(self.ctx, mine) if r is not None)
        return mine

    def _rule(self, loss: float) -> str | None:
        rank = self.ctx.rank
        if not math.isfinite(loss):
            return f"loss {loss} on rank {rank}"
        if len(self.losses) >= MIN_HISTORY:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                return (f"loss {loss:.4g} on rank {rank}, over {self.factor:g} x the median {median:.4g} of its last "
                        f"{len(self.losses)} (train.spike_factor)")
        return None

    def allowed(self, step: int, why: str) -> None:
        """Refuse a rollback past `train.max_rollbacks`: the run stops, naming the ones it made."""
        if len(self.log.rollbacks) >= self.max_rollbacks:
            made = "; ".join(map(str, self.log.rollbacks)) or "none"
            raise FatalError(f"training diverged at step {step} ({why}) after {len(self.log.rollbacks)} rollback(s) "
                             f"(train.max_rollbacks {self.max_rollbacks}; made: {made}). Lower train.lr, or look at "
                             "the data of the steps named; retrying would diverge again")

    def record(self, step: int, why: str, restored_from: int, samples: list[int]) -> Rollback:
        """Skip step `step` from now on, in this attempt and any that resumes from before it."""
        entry = Rollback(step=step, reason=why, restored_from=restored_from, samples=samples)
        self.log = RollbackLog(rollbacks=[*self.log.rollbacks, entry])
        self.skips.add(step)
        if self.ctx.is_main:
            self.store.write(ROLLBACKS, dump(self.log))
        return entry
