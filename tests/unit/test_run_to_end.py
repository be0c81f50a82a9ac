"""An interrupted wait for a job cancels it, and never waits on a backend that no longer answers."""

import logging
import threading

import pytest

from trnflow.backends.base import JobRequest, cancel_within, run_to_end


class Hanging:
    """A backend whose job never ends and whose cancel never returns (an endpoint that is gone)."""

    name = "batch"

    def __init__(self):
        self.cancelling = threading.Event()
        self.release = threading.Event()

    def submit(self, request):
        return "job-1"

    def describe(self, job_id):
        raise KeyboardInterrupt  # SIGTERM arrives while the caller polls

    def logs(self, job_id, since=0):
        return "", since

    def cancel(self, job_id):
        self.cancelling.set()
        self.release.wait(60)

    @staticmethod
    def stop_command(job_id):
        return f"aws batch terminate-job --job-id {job_id}"


def test_an_interrupted_wait_cancels_the_job_and_gives_up_on_a_backend_that_does_not_answer(caplog, monkeypatch):
    backend = Hanging()
    monkeypatch.setattr("trnflow.backends.base.CANCEL_SECONDS", 0.2)
    with caplog.at_level(logging.WARNING, logger="trnflow.backends"), pytest.raises(KeyboardInterrupt):
        run_to_end(backend, JobRequest(None, "sanity", "r", processes=1))
    backend.release.set()
    assert backend.cancelling.is_set()  # it was asked
    (record,) = caplog.records
    assert "could not cancel batch job job-1 (the batch backend did not answer within 0.2 s)" in record.getMessage()
    assert "stop it with `aws batch terminate-job --job-id job-1`" in record.getMessage()


def test_a_cancel_that_answers_is_waited_for():
    class Answers(Hanging):
        def cancel(self, job_id):
            self.cancelling.set()

    backend = Answers()
    assert cancel_within(backend, "job-1", 5.0) is True and backend.cancelling.is_set()


def test_the_backends_warnings_reach_the_task_run_log_from_its_own_thread_only():
    from trnflow.tasks._jobs import _forwarded

    class TaskLog:
        def __init__(self):
            self.lines = []

        def log(self, level, fmt, *args):
            self.lines.append((level, fmt % args))

    task_log, source = TaskLog(), logging.getLogger("trnflow.backends")
    with _forwarded(source, task_log):
        source.warning("sanity of run r waits up to %g min for its NeuronCores: %s", 5, "nc0 held by pid 7")
        source.info("not a warning")
        other = threading.Thread(target=lambda: source.warning("another task's wait"))
        other.start()
        other.join()
    source.warning("after the block")
    told = "sanity of run r waits up to 5 min for its NeuronCores: nc0 held by pid 7"
    assert task_log.lines == [(logging.WARNING, told)]
