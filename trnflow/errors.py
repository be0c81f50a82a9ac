"""The error taxonomy. Each class says who may retry it; messages say what to do next."""

from __future__ import annotations

from enum import IntEnum
from typing import Any


class TrnflowError(Exception):
    """Base class. `retryable` tells the Prefect tasks whether a retry can help; `bad_cores` names
    the NeuronCores found at fault, when any were."""

    retryable = False

    def __init__(self, message: str = "", bad_cores: list[int] | None = None):
        super().__init__(message)
        self.bad_cores = sorted(bad_cores or [])


class FatalError(TrnflowError):
    """Retrying cannot help: bad input, compiler error, numerical divergence. Fix the cause and rerun."""


class DataError(FatalError):
    """Input data that cannot be read or does not match the spec."""


class FieldError(FatalError):
    """A spec field whose value cannot be used on this machine, such as a recipe whose optional
    packages are not installed: `field` names it, and the message starts with it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Recompilation(FatalError):
    """More graphs compiled during a run than `compile.max_recompiles` allows (a changed shape, usually)."""


class TransientError(TrnflowError):
    """A lost core, a timeout or missing capacity: the stage is retried and resumes from its checkpoint."""

    retryable = True


class CollectiveTimeout(TransientError):
    """A collective did not complete in time: a core hung or a link went down."""


class Stalled(TransientError):
    """A rank made no progress for `compute.hang_timeout_minutes` (a host or device that stopped
    answering): it was ended, naming its rank and host, and the stage is retried."""


class SpotInterruption(TransientError):
    """The spot instance was about to be reclaimed: training wrote a checkpoint at the next step
    boundary and ended; the retry resumes from it."""


class Interrupted(TransientError):
    """The job was asked to stop (SIGTERM: its run yields its capacity, a person cancelled it, the
    service stopped it): training wrote a checkpoint at the next step boundary and ended; a rerun
    of the run resumes from it exactly."""


class Preempted(TrnflowError):
    """The run yielded its capacity to a higher-priority run: its training checkpointed at a step
    boundary, and the run queues again to resume from there. The run's business, never a stage's
    retry."""


class ExecutionTimeout(TransientError):
    """The runtime gave up on a program that did not finish in time; a retry resumes from the checkpoint."""


class HardwareError(TransientError):
    """A NeuronCore reported a hardware fault (`bad_cores`); the retry runs on other cores."""


class BadHost(TransientError):
    """An instance failed the preflight of the job that was to train on it (a core that failed its
    known-answer tests, a node that hung, a collective between the nodes that failed): the job ends
    before training so that its hosts are replaced. Batch's retry strategy retries it on other
    instances (the bad ones are terminated first); on SageMaker trnflow submits the job again, which
    gets new instances. The preflight then runs again on them."""


class CapacityError(TransientError):
    """The service had no capacity for the instances asked for; a later submission may get them.
    Neither SageMaker nor Batch retries this itself, so trnflow resubmits."""


class InternalServiceError(FatalError):
    """SageMaker failed the job with an internal error after its own `RetryStrategy` was used up.
    That strategy is the one retry owner of internal errors, so trnflow does not resubmit."""


class HostFailure(FatalError):
    """AWS Batch ended the job for a host, agent or start-up failure (or a transient device fault)
    after its own `retryStrategy` was used up; that strategy owns these retries."""


class UserError(FatalError):
    """The job's own code failed (SageMaker's AlgorithmError, a non-zero exit on Batch). Fix the
    cause shown in the job's log and rerun."""


class JobTimeout(FatalError):
    """The job reached `compute.max_runtime_hours`. Raise it, or checkpoint more often and rerun:
    the rerun resumes from the last checkpoint."""


class DiskFull(FatalError):
    """No space left where a file was being written. Retrying at once would fill the same disk, so
    it is not retried: free space, then rerun with the same run id to resume from the last
    committed checkpoint (the failed write left nothing half-written behind)."""


class GateDecision(FatalError):
    """The evaluation stage decided against the candidate: the run ends in a state named after the
    subclass, whose message is `headline`. Never retried."""

    def __init__(self, message: str, verdict: Any = None, bad_cores: list[int] | None = None,
                 headline: str | None = None):
        super().__init__(message, bad_cores)
        self.verdict = verdict
        """The gate's verdict (a `trnflow.records.Verdict`)."""
        self.headline = headline or message
        """The reason in one short line, for a run's state message."""


class GateFailed(GateDecision):
    """The candidate model is outside the accuracy-parity band. Never retried; the champion stays."""


class ChampionKept(GateDecision):
    """The candidate passed the gate but is worse than the champion on the same holdout: it is
    registered, not promoted. Never retried; `--force-promote --reason` overrides."""


class OverBudget(FatalError):
    """Training stopped at a step boundary, checkpointed, because the cost spent plus the forecast for
    the steps left would exceed its budget (the job's `--budget-usd`: `train.max_cost_usd`, or what
    `compute.max_cost_usd` leaves for training).
    Not retried: the run ends in a state of this name; rerunning it with the same run id and a higher
    budget resumes from that checkpoint."""


ERROR_TYPES: dict[str, type[TrnflowError]] = {
    cls.__name__: cls
    for cls in (TrnflowError, FatalError, DataError, Recompilation, TransientError, CollectiveTimeout, Stalled,
                SpotInterruption, Interrupted, Preempted,
                ExecutionTimeout, HardwareError, BadHost, CapacityError, InternalServiceError, HostFailure, UserError,
                JobTimeout, DiskFull, GateFailed, ChampionKept, OverBudget)
}


class ExitCode(IntEnum):
    """How a trnflow process ends: the `trnflow` command, the workload and the training container
    all exit with these, so a script or a service's retry strategy can rely on them."""

    OK = 0
    FAILED = 1
    """The job or run failed (a retry of the whole thing may help, or the logs say why not)."""
    BAD_INPUT = 2
    """A spec, file, argument or server setting is wrong: fix it and run again."""
    GATE_FAILED = 3
    """The candidate did not pass the accuracy-parity gate: nothing was promoted."""
    NOT_ENDED = 4
    """Not now: the run has not ended yet (`status`, `submit --wait --timeout`)."""
    CONFLICT = 4
    """Not now: someone else changed the registry first; look again and retry."""
    CHAMPION_KEPT = 5
    """The candidate passed the gate but is worse than the champion: registered, not promoted
    (`--force-promote --reason` overrides)."""
    OVER_BUDGET = 6
    """Training stopped, checkpointed, because the run would exceed its budget (`OverBudget`):
    rerun with the same run id and a higher budget to resume."""
    BUG = 70
    """trnflow itself failed (EX_SOFTWARE): the command printed the traceback to report."""
    TRANSIENT = 75
    """A transient fault in the container (EX_TEMPFAIL): the service's retry strategy retries it."""
    BAD_HOST = 79
    """The container's instance failed the preflight (`BadHost`): Batch's retry strategy retries it on
    other instances."""
    INTERRUPTED = 130
    """Stopped by Ctrl-C or SIGTERM: the message names the run and the command that resumes it."""
