"""A notice to stop, as the ranks of a training job act on it: spot capacity's reclaim notice, and
the SIGTERM any job gets when it is stopped (its run yields its cores to a higher-priority run, a
person cancels it, the service stops it). Either way training checkpoints at its next step boundary.

The service sends SIGTERM about two minutes before it takes a spot instance back (SageMaker's
managed spot training; the container passes the signal on to the launcher, and torchrun to every
rank). AWS Batch sends no such signal: EC2's notice appears only in the instance metadata service
(`spot/instance-action`), so there (`TRNFLOW_RECLAIM_NOTICE=imds`, set by the container) each
node's first rank asks it at every step boundary. A rank that got the notice only notes it: the
ranks agree at each step boundary whether any of them got it (one small all-reduce), so that they
all stop after the same step. Then the training phase writes a checkpoint of that step and ends
with `SpotInterruption`, which is transient: the retry (the service's restart, Batch's retry
strategy, or trnflow's resubmission) resumes from that checkpoint exactly.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping

from trnflow.aws import RECLAIM_NOTICE_ENV, InstanceMetadata
from trnflow.workload.collectives import all_true
from trnflow.workload.context import WorkerContext


class ReclaimNotice:
    """Set by SIGTERM on this rank; `agreed()` says whether any rank got it (a collective: every
    rank calls it at the same step). `spot`: the instance may also be reclaimed, which on Batch only
    the instance metadata service says."""

    def __init__(self, ctx: WorkerContext, env: Mapping[str, str] | None = None, spot: bool = True):
        self.ctx = ctx
        self.seen = False
        self.spot = spot
        self._before = signal.signal(signal.SIGTERM, self._notice)
        env = os.environ if env is None else env
        asks = spot and env.get(RECLAIM_NOTICE_ENV) == "imds" and ctx.local_rank == 0
        self._imds = InstanceMetadata(env) if asks else None

    def close(self) -> None:
        """Give SIGTERM back its handler from before (training has ended)."""
        signal.signal(signal.SIGTERM, self._before)

    def _notice(self, signum: int, frame: object) -> None:
        if not self.seen:
            what = "the reclaim notice" if self.spot else "a request to stop"
            print(f"trnflow.workload: rank {self.ctx.rank} got {what} (SIGTERM): checkpointing at the "
                  "next step boundary", file=sys.stderr, flush=True)
        self.seen = True

    def agreed(self) -> bool:
        if not self.seen and self._imds is not None and (notice := self._imds.reclaim_notice()) is not None:
            print(f"trnflow.workload: rank {self.ctx.rank}: EC2 will reclaim this spot instance ({notice}): "
                  "checkpointing at this step boundary", file=sys.stderr, flush=True)
            self.seen = True
        if self.ctx.world_size == 1:
            return self.seen
        if not self.spot:  # at every step of every run: one small all-reduce, no progress record written
            return not all_true(not self.seen)
        # a rank that never arrives is named, as in any collective step
        return not self.ctx.collective("agreeing on the reclaim notice", lambda: all_true(not self.seen))
