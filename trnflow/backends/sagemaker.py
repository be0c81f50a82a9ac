"""The SageMaker backend: each stage job is a SageMaker training job.

`submit` hands the spec over in the staging bucket and sends the request built by
`sagemaker_request` through the SDK's ModelTrainer, as a role made for the job (`JobRoles`, deleted
when it ends); `describe` polls `DescribeTrainingJob`
(through `trnflow.aws`, which retries throttling and 5xx) and, once the job has completed, reads
rank 0's result from the job's output.tar.gz; `logs` reads CloudWatch; `cancel` stops the job.
"""

from __future__ import annotations

import time
from typing import Any

from botocore.exceptions import ClientError

from trnflow import aws
from trnflow.backends import sagemaker_trainer
from trnflow.backends.base import JobDetails, JobInfo, JobRequest, JobState, fitted, stage_result
from trnflow.backends.cloud import (
    CloudTarget,
    JobRoles,
    NodeWatch,
    stage_spec,
    staging_prefix,
)
from trnflow.backends.cloudwatch import StreamReader, streams
from trnflow.backends.provisioning import sagemaker_provisioning
from trnflow.backends.sagemaker_request import build_training_job_request, longest_seconds
from trnflow.backends.service_status import sagemaker_failure, sagemaker_state
from trnflow.errors import FatalError
from trnflow.results import StageResult
from trnflow.safetar import read_member
from trnflow.storage import Store, open_store
from trnflow.storage.s3 import split_s3_url

LOG_GROUP = "/aws/sagemaker/TrainingJobs"


SUBMIT_ATTEMPTS = 4
ROLE_WAIT_SECONDS = 10.0


def _role_not_yet_assumable(exc: ClientError) -> bool:
    """SageMaker's answer to a role IAM has not spread yet ("Could not assume role ...")."""
    error = exc.response.get("Error", {})
    return error.get("Code") == "ValidationException" and "assume" in error.get("Message", "").lower()


class SageMakerBackend:
    name = "sagemaker"
    shares_allocation = True
    """The preflight and training run as phases of one training job, on the same instances."""
    picks_instance_type = True
    """SageMaker chooses among compute.instance_preferences itself (the request's InstancePreferences)."""

    def __init__(self, target: CloudTarget):
        self.target = target
        self._session = aws.session()
        self._sm = aws.client("sagemaker", boto_session=self._session)
        self._logs = aws.client("logs", boto_session=self._session)
        self._s3 = aws.client("s3", boto_session=self._session)
        self._read: dict[str, dict[str, int]] = {}  # job -> stream -> events read
        self._reader = StreamReader(self._logs, LOG_GROUP)
        self._outputs: dict[str, Store] = {}  # job -> where its nodes upload their failures
        self.nodes = NodeWatch()  # stops a job whose other host failed while its main host went on
        self.roles = JobRoles(target, self._session)

    def submit(self, request: JobRequest) -> str:
        if request.spec is None:
            raise FatalError(f"the {request.phase} phase needs a job spec to run on SageMaker")
        request = fitted(request)
        role = self.roles.make(request, longest_seconds(request))
        try:
            body = build_training_job_request(request, self.target, role)
            stage_spec(self.target, request)
            job_id = self._create(body)
        except BaseException:
            self.roles.unused(role)
            raise
        self.roles.submitted(job_id, role)
        self._outputs[job_id] = open_store(f"{staging_prefix(self.target, request)}/output/{job_id}")
        return job_id

    def _create(self, body: dict[str, Any]) -> str:
        bucket, _ = split_s3_url(self.target.staging_url)
        for attempt in range(1, SUBMIT_ATTEMPTS + 1):
            try:
                return aws.call(sagemaker_trainer.submit, body, self._session, bucket)
            except self._sm.exceptions.ResourceInUse:
                # ModelTrainer names jobs to the second; a resubmission within the same second waits
                if attempt == SUBMIT_ATTEMPTS:
                    raise
                time.sleep(1.1)
            except ClientError as exc:
                # a job's new role may not have reached SageMaker's IAM endpoint yet
                if attempt == SUBMIT_ATTEMPTS or not _role_not_yet_assumable(exc):
                    raise
                time.sleep(ROLE_WAIT_SECONDS)
        raise AssertionError("unreachable")

    def _describe(self, job_id: str) -> dict[str, Any]:
        return aws.call(self._sm.describe_training_job, TrainingJobName=job_id)

    def outputs(self, job_id: str) -> Store:
        """Where the job's hosts leave their failures, phase results and identities as it runs (jobs
        submitted from this process only)."""
        if job_id not in self._outputs:
            raise KeyError(f"SageMaker job {job_id} was not submitted here: where its hosts report is not known")
        return self._outputs[job_id]

    def describe(self, job_id: str) -> JobInfo:
        desc = self._describe(job_id)
        state = sagemaker_state(desc)
        if state.terminal:
            self.roles.ended(job_id)
        restarts = sum(1 for t in desc.get("SecondaryStatusTransitions", []) if t.get("Status") == "Restarting")
        config = desc.get("ResourceConfig") or {}
        started = sagemaker_provisioning(desc)
        count = config.get("SelectedInstanceCount") or config.get("InstanceCount") or 0
        details = JobDetails(
            seconds=desc.get("BillableTimeInSeconds"), status=desc["TrainingJobStatus"], restarts=restarts,
            instance_type=(config.get("SelectedInstanceType") or config.get("InstanceType") or "")
            .removeprefix("ml.") or None, spot=bool(desc.get("EnableManagedSpotTraining")),
            running_seconds=desc.get("TrainingTimeInSeconds"), hosts=[f"algo-{i + 1}" for i in range(count)],
            instances_started=started.instances_started, provisioning_seconds=started.seconds)
        if state is JobState.RUNNING:
            self._stop_if_a_node_failed(job_id, desc)
        if state in (JobState.FAILED, JobState.CANCELLED) and self.nodes.stopped(job_id):
            return JobInfo(job_id, JobState.FAILED, failure=self.nodes.failure(job_id, f"SageMaker job {job_id}"),
                           details=details)
        if state is JobState.SUCCEEDED:
            return JobInfo(job_id, state, result=self._result(desc), details=details)
        if state is JobState.FAILED:
            return JobInfo(job_id, state, failure=sagemaker_failure(desc), details=details)
        return JobInfo(job_id, state, details=details)

    def _stop_if_a_node_failed(self, job_id: str, desc: dict[str, Any]) -> None:
        """Stop a running job one of whose other hosts has failed (`NodeWatch`); the hosts' root
        failure then says whether trnflow resubmits it. Only jobs submitted here are watched (their
        hosts' reports are in this submission's staging folder)."""
        outputs = self._outputs.get(job_id)
        if outputs is None:
            return
        training = [t["StartTime"] for t in desc.get("SecondaryStatusTransitions", []) if t.get("Status") == "Training"]
        if self.nodes.should_stop(job_id, outputs, training[-1].timestamp() if training else 0.0):
            self.cancel(job_id)  # a job that ended meanwhile has nothing to stop

    def _result(self, desc: dict[str, Any]) -> StageResult:
        """Rank 0's result.json, from `<S3OutputPath>/<job>/output/output.tar.gz`."""
        name = desc["TrainingJobName"]
        url = f"{desc['OutputDataConfig']['S3OutputPath'].rstrip('/')}/{name}/output/output.tar.gz"
        bucket, _, key = url.removeprefix("s3://").partition("/")
        data = aws.call(self._s3.get_object, Bucket=bucket, Key=key)["Body"].read()
        result = read_member(data, "result.json", url)  # read in memory: nothing a job wrote is unpacked here
        if result is None:
            raise FatalError(f"{url} has no result.json; the job completed without its workload's result")
        return stage_result(name, result, None)

    def logs(self, job_id: str, since: int = 0) -> tuple[str, int]:
        """The main host's lines. Each attempt of the job writes a stream of its own
        (`<job>/algo-1-<start time>`: SageMaker's retry of an internal error starts a new one), so
        they are read in order; `since` counts the events read across them."""
        read = self._read.setdefault(job_id, {})
        if since != sum(read.values()):  # not where this reader left off: start again, skip `since`
            read.clear()
        skip = since - sum(read.values())
        parts = []
        for stream in streams(self._logs, LOG_GROUP, f"{job_id}/algo-1-"):
            text, read[stream] = self._reader.read(stream, read.get(stream, 0))
            parts.append(text)
        lines = "".join(parts).splitlines(keepends=True)[skip:]
        return "".join(lines), since + len(lines)

    def cancel(self, job_id: str) -> None:
        try:
            aws.call(self._sm.stop_training_job, TrainingJobName=job_id)
        except self._sm.exceptions.ClientError as exc:
            if "ValidationException" not in str(exc):  # already ended: nothing to stop
                raise

    def interrupt(self, job_id: str) -> None:
        """Ask the job to stop: SageMaker sends its containers SIGTERM and waits 120 s before it
        ends them, time for training to checkpoint at its next step boundary (and upload it)."""
        self.cancel(job_id)

    @staticmethod
    def stop_command(job_id: str) -> str:
        """The AWS CLI command that stops the job, for a person to run when trnflow could not."""
        return f"aws sagemaker stop-training-job --training-job-name {job_id}"
