"""Only transient failures are retried, by Prefect, with the spec's policy."""

from prefect import flow, task

from trnflow.errors import FatalError, GateFailed, TransientError
from trnflow.tasks.retry_policy import retry_options


def _flaky_flow(spec, error: Exception, failures: int):
    attempts = []

    @task
    def stage():
        attempts.append(1)
        if len(attempts) <= failures:
            raise error
        return "done"

    @flow
    def run() -> str:
        return stage.with_options(**retry_options(spec))(return_state=True).type.value

    return run(), len(attempts)


def test_transient_failures_are_retried_until_success(prefect_api, make_spec):
    spec = make_spec(retries={"max_retries": 2, "backoff_seconds": 0})
    state, attempts = _flaky_flow(spec, TransientError("execution timeout"), failures=2)
    assert state == "COMPLETED" and attempts == 3


def test_retries_stop_at_the_spec_limit(prefect_api, make_spec):
    spec = make_spec(retries={"max_retries": 1, "backoff_seconds": 0})
    state, attempts = _flaky_flow(spec, TransientError("execution timeout"), failures=5)
    assert state == "FAILED" and attempts == 2


def test_fatal_errors_and_failed_gates_are_never_retried(prefect_api, make_spec):
    spec = make_spec(retries={"max_retries": 3, "backoff_seconds": 0})
    for error in (FatalError("bad spec"), GateFailed("outside the band"), ValueError("bug")):
        state, attempts = _flaky_flow(spec, error, failures=5)
        assert state == "FAILED" and attempts == 1, error


def test_job_failures_map_onto_the_error_classes():
    from trnflow.backends import JobInfo, JobState
    from trnflow.errors import CollectiveTimeout, DataError
    from trnflow.results import FailureReport
    from trnflow.tasks._jobs import classify

    def failed(**failure):
        return classify(JobInfo("j1", JobState.FAILED, failure=FailureReport(**failure)))

    assert isinstance(failed(type="DataError", message="bad column", retryable=False), DataError)
    hung = failed(type="CollectiveTimeout", message="core 3 hung", retryable=True, bad_cores=[3])
    assert isinstance(hung, CollectiveTimeout) and hung.retryable and hung.bad_cores == [3]
    assert isinstance(failed(type="CoresUnavailable", message="held", retryable=True), TransientError)
    assert isinstance(failed(type="WorkerLost", message="killed", retryable=True), TransientError)
    unknown = failed(type="RuntimeError", message="a bug", retryable=None)
    assert isinstance(unknown, FatalError) and "a bug" in str(unknown)
    assert isinstance(failed(type="GateFailed", message="outside the band"), GateFailed)
    assert isinstance(classify(JobInfo("j2", JobState.CANCELLED)), FatalError)
