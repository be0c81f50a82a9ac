"""What each cloud service's failures mean and who retries them: a user error never retried, throttling
while polling, the failure classes and retry owners, and the log reader."""


import json
import logging
import time

import pytest

from tests.clouds import (
    HOST_LOST,
    cloud_spec,
    in_cloud,
)
from tests.conftest import ON_S3, quickstart_data
from trnflow.backends import JobRequest
from trnflow.backends.service_status import batch_failure, sagemaker_failure, sagemaker_state
from trnflow.flows.pipeline import pipeline
from trnflow.results import FailureReport
from trnflow.settings import TrnflowSettings
from trnflow.testing.mockcloud import ServiceFault


@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_a_user_error_fails_the_stage_once_and_is_never_retried(
        service, prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    import boto3

    report = json.dumps({"type": "DataError", "retryable": False, "message": "data.train has no rows"})
    fault = (ServiceFault("sagemaker", "sanity", f"AlgorithmError: {report}") if service == "sagemaker" else
             ServiceFault("batch", "sanity", "Essential container in task exited", exit_code=1))
    began = time.time() * 1000  # the moto server is the session's: earlier tests' jobs are in it too
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault]) as (_, bucket):
        earlier = {j["TrainingJobName"] for j in boto3.client("sagemaker").list_training_jobs(
            MaxResults=100)["TrainingJobSummaries"]}  # the last test's may have been made within the last second
        state = pipeline(cloud_spec(make_spec, bucket, service), return_state=True)
        assert state.is_failed()
        message = str(state.result(raise_on_failure=False))
        if service == "sagemaker":
            assert "DataError" in message and "data.train has no rows" in message
            jobs = boto3.client("sagemaker").list_training_jobs(MaxResults=100)["TrainingJobSummaries"]
            assert len([j for j in jobs if j["TrainingJobName"] not in earlier]) == 1
        else:
            assert "exit code 1" in message
            jobs = [j for j in boto3.client("batch").list_jobs(jobQueue="trnflow-trn1", jobStatus="FAILED")[
                "jobSummaryList"] if j["createdAt"] >= began]
            assert len(jobs) == 1
            (job,) = boto3.client("batch").describe_jobs(jobs=[jobs[0]["jobId"]])["jobs"]
            assert len(job["attempts"]) == 1  # the EXIT rule: Batch did not retry it either


def test_throttling_while_polling_is_retried_without_failing(moto_endpoint, tmp_path, monkeypatch, dataset,
                                                             make_spec, caplog):
    from botocore.awsrequest import AWSResponse

    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend

    fault = ServiceFault("sagemaker", "train", "AlgorithmError: bad input")
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault]) as (cloud, bucket):
        backend = SageMakerBackend(cloud_target(TrnflowSettings(), "sagemaker"))
        job = backend.submit(JobRequest(cloud_spec(make_spec, bucket, "sagemaker"), "train", "throttled"))
        cloud.wait_idle()
        throttles = iter(range(2))

        def throttle(**_):
            if next(throttles, None) is not None:
                error = {"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"},
                         "ResponseMetadata": {"HTTPStatusCode": 400}}
                return AWSResponse("http://sagemaker", 400, {}, None), error
            return None

        backend._sm.meta.events.register("before-call.sagemaker.DescribeTrainingJob", throttle)
        monkeypatch.setattr("trnflow.aws.FIRST_WAIT_SECONDS", 0.01)
        with caplog.at_level(logging.WARNING, logger="trnflow.aws"):
            info = backend.describe(job)
        assert info.state.value == "FAILED" and info.failure.type == "UserError"
        assert len([r for r in caplog.records if "ThrottlingException" in r.getMessage()]) == 2


def test_each_service_failure_maps_to_its_error_class_and_retry_owner():
    def sm(reason, secondary="Failed"):
        return sagemaker_failure({"TrainingJobName": "j", "FailureReason": reason, "SecondaryStatus": secondary,
                                  "StoppingCondition": {"MaxRuntimeInSeconds": 60}})

    assert sm("CapacityError: Unable to provision").type == "CapacityError"  # trnflow resubmits
    assert sm("CapacityError: Unable to provision").retryable
    assert sm("InternalServerError: oops").type == "InternalServiceError"  # SageMaker retried it already
    transient = sm('AlgorithmError: {"type": "ExecutionTimeout", "retryable": true, "message": "nc3"}')
    assert transient.type == "ExecutionTimeout" and transient.retryable  # a device fault: resubmitted
    assert sm("AlgorithmError: Traceback ...").type == "UserError"
    assert sm("", secondary="MaxRuntimeExceeded").type == "JobTimeout"
    spot = sm("", secondary="MaxWaitTimeExceeded")
    assert spot.type == "CapacityError" and spot.retryable and "compute.max_wait_hours" in spot.message
    pending = {"TrainingJobName": "j", "TrainingJobStatus": "Stopped", "SecondaryStatus": "Stopped",
               "StoppingCondition": {"MaxPendingTimeInSeconds": 1800},
               "SecondaryStatusTransitions": [{"Status": "Starting"}, {"Status": "Stopped"}]}
    assert sagemaker_state(pending).value == "FAILED"  # SageMaker stopped it waiting for capacity
    assert sagemaker_failure(pending).type == "CapacityError" and sagemaker_failure(pending).retryable
    trained = {**pending, "SecondaryStatusTransitions": [{"Status": "Training"}, {"Status": "Stopped"}]}
    assert sagemaker_state(trained).value == "CANCELLED"  # stopped by a person once it ran

    from trnflow.backends.batch_request import retry_strategy

    rules = retry_strategy(_spec_for_rules())["evaluateOnExit"]

    def batch(code, status_reason, report=None, reason=""):
        return batch_failure({"jobId": "id", "jobName": "n", "attempts": [
            {"container": {"exitCode": code, "reason": reason}, "statusReason": status_reason}] * 3}, rules, report)

    host = batch(None, HOST_LOST)
    assert host.type == "HostFailure" and not host.retryable and "retried n (id) 3 time(s)" in host.message
    assert batch(75, "Essential container in task exited").type == "HostFailure"  # exit 75: Batch's to retry
    assert batch(79, "Essential container in task exited").type == "HostFailure"  # a bad host: Batch's too
    agent = batch(None, "Essential container in task exited", reason="AGENT")  # no rule left for it: trnflow's
    assert agent.type == "AgentLost" and agent.retryable
    user = batch(1, "Essential container in task exited")
    assert user.type == "UserError" and "exit code 1" in user.message
    named = batch(1, "Essential container in task exited", FailureReport(type="GateFailed", message="outside the band"))
    assert named.type == "GateFailed" and not named.retryable


def _spec_for_rules():
    from trnflow.specs import validate_spec

    return validate_spec(quickstart_data(compute={"backend": "batch", "instance_type": "trn1.32xlarge"},
                                         train={"checkpoint_url": "s3://acme-data/ckpt"}, **ON_S3))


def test_the_log_reader_returns_only_new_lines_and_continues_from_its_page_token(in_process_aws):
    import boto3

    from trnflow.backends.cloudwatch import StreamReader

    logs = boto3.client("logs")
    logs.create_log_group(logGroupName="/g")
    logs.create_log_stream(logGroupName="/g", logStreamName="s")

    def put(*lines):
        logs.put_log_events(logGroupName="/g", logStreamName="s",
                            logEvents=[{"timestamp": int(time.time() * 1000), "message": m} for m in lines])

    reader, calls = StreamReader(logs, "/g"), []
    logs.meta.events.register("provide-client-params.logs.GetLogEvents",
                              lambda params, **_: calls.append(dict(params)))
    assert reader.read("s", 0) == ("", 0)
    put("one", "two")
    text, cursor = reader.read("s", 0)
    assert (text, cursor) == ("one\ntwo\n", 2)
    put("three")
    assert reader.read("s", cursor) == ("three\n", 3)
    assert "nextToken" in calls[-1] or "nextToken" in calls[-2]  # it did not start from the head again
    assert StreamReader(logs, "/g").read("s", 2) == ("three\n", 3)  # a new reader skips what was read
