"""The retry policy of every stage task: only transient failures are retried, with exponential
backoff and jitter taken from the spec. Bad specs, compiler errors and a failed gate never are."""

from __future__ import annotations

from typing import Any

from prefect.tasks import exponential_backoff

from trnflow.errors import TransientError
from trnflow.specs import JobSpec


def only_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry_condition_fn: retry a failed run only when its error is transient."""
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(error, TransientError)


def retry_options(spec: JobSpec) -> dict[str, Any]:
    """Options for `task.with_options(...)`."""
    policy = spec.retries
    return {
        "retries": policy.max_retries,
        "retry_delay_seconds": exponential_backoff(backoff_factor=policy.backoff_seconds),
        "retry_jitter_factor": policy.jitter,
        "retry_condition_fn": only_transient,
    }
