"""The Batch backend relays a job's log across its attempts: each attempt writes a stream of its
own, and a retry's stream is read from its start."""

from __future__ import annotations

import time

import boto3
import pytest

from trnflow.backends.batch import LOG_GROUP, BatchBackend
from trnflow.backends.cloud import CloudTarget
from trnflow.backends.service_status import batch_failure
from trnflow.results import FailureReport


def _put(logs, stream, lines):
    logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
    now = int(time.time() * 1000)
    logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=stream,
                        logEvents=[{"timestamp": now + i, "message": m} for i, m in enumerate(lines)])


@pytest.mark.usefixtures("in_process_aws")
def test_a_retried_jobs_log_goes_on_with_the_new_attempts_stream(monkeypatch):
    logs = boto3.client("logs")
    logs.create_log_group(logGroupName=LOG_GROUP)
    _put(logs, "def/default/first", ["step 1", "step 2"])
    backend = BatchBackend(CloudTarget(staging_url="s3://staging/jobs", job_queue="q"))
    current = {"stream": "def/default/first"}
    monkeypatch.setattr(backend, "_describe", lambda job_id: {"container": {"logStreamName": current["stream"]}})
    text, cursor = backend.logs("job", 0)
    assert text == "step 1\nstep 2\n" and cursor == 2
    _put(logs, "def/default/second", ["resume at 2", "step 3"])
    current["stream"] = "def/default/second"  # Batch retried the job: its second attempt logs here
    text, cursor = backend.logs("job", cursor)
    assert text == "resume at 2\nstep 3\n" and cursor == 4
    assert backend.logs("job", cursor) == ("", 4)


def test_a_job_reclaimed_in_every_attempt_is_submitted_again_not_failed():
    desc = {"jobName": "spec-train-r1", "jobId": "j1", "attempts": [
        {"container": {"exitCode": 75}, "statusReason": "Essential container in task exited"}] * 2}
    rules = [{"action": "RETRY", "onExitCode": "75"}, {"action": "EXIT", "onReason": "*"}]
    reclaimed = FailureReport(type="SpotInterruption", retryable=True, message="the instance is being reclaimed")
    found = batch_failure(desc, rules, reclaimed)
    assert found.type == "SpotInterruption" and found.retryable and "2 attempt(s)" in found.message
    lost = batch_failure(desc, rules, FailureReport(type="Stalled", retryable=True, message="rank 0 stalled"))
    assert lost.type == "HostFailure" and not lost.retryable
