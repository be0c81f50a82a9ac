"""The SageMaker `CreateTrainingJob` request for one stage job: a pure function of the request
and the deployment target. `sagemaker_trainer` sends it through the SDK's ModelTrainer.

SageMaker runs the image as `<entrypoint> train`; the image's entrypoint is
`python -m trnflow.backends.container`, which reads SageMaker's contract and starts torchrun with one
process per NeuronCore of the instance. The run's checkpoint folder is the job's
`CheckpointConfig.S3Uri`, so a retried or resubmitted job resumes from it.
"""

from __future__ import annotations

from typing import Any

from trnflow.backends.base import JobRequest
from trnflow.backends.cloud import (
    BASE_NAME_LENGTH,
    CHECKPOINT_DIR,
    CloudTarget,
    checkpoint_s3_uri,
    container_environment,
    job_name,
    placement,
    runtime_seconds,
    spec_url,
    tags,
)
from trnflow.errors import FatalError
from trnflow.settings import STAGE_KINDS
from trnflow.specs import JobSpec, sagemaker_checkpoint_problem

MAX_RETRY_ATTEMPTS = 30
"""SageMaker's limit for RetryStrategy.MaximumRetryAttempts."""


MIN_PENDING_SECONDS = 1800
"""SageMaker's least StoppingCondition.MaxPendingTimeInSeconds (the spec refuses less)."""

def _channel(name: str, url: str, field: str, mode: str = "FastFile") -> dict[str, Any]:
    """An S3 channel. Data channels are FastFile: the workload reads its shards from S3 itself (the
    sampler picks them by step), so SageMaker copies nothing before the job starts."""
    if not url.startswith("s3://"):
        raise FatalError(f"{field}: {url} is not on S3; SageMaker jobs read their data from s3:// locations. "
                         "Upload it, or run with compute.backend: local")
    return {"ChannelName": name, "InputMode": mode, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": url, "S3DataDistributionType": "FullyReplicated"}}}


def _checkpoint_config(spec: JobSpec, run_id: str) -> dict[str, str]:
    """The run's checkpoint folder, which SageMaker syncs with CHECKPOINT_DIR. Spec validation
    refuses a SageMaker spec whose checkpoints are not on S3; this refuses it again for a spec
    changed since (`model_copy` does not validate), so no file:// URI ever reaches SageMaker."""
    problem = sagemaker_checkpoint_problem(spec.train.checkpoint_url)
    if problem:
        raise FatalError(problem)
    return {"S3Uri": checkpoint_s3_uri(spec, run_id), "LocalPath": CHECKPOINT_DIR}


def resource_config(spec: JobSpec, instances: int) -> dict[str, Any]:
    """The instances: one type, or (compute.instance_preferences) SageMaker's ordered
    `InstancePreferences`, of which it launches the first that has capacity; a training plan's
    reserved capacity when compute.training_plan names one."""
    compute = spec.compute
    config: dict[str, Any] = {"InstanceCount": instances, "VolumeSizeInGB": compute.volume_gb}
    if compute.instance_preferences:
        config["InstancePreferences"] = [{"InstanceType": f"ml.{t}"} for t in compute.instance_preferences]
    else:
        config["InstanceType"] = f"ml.{compute.instance_type}"
    if compute.training_plan:
        config["TrainingPlanArn"] = compute.training_plan
    return config


def stopping_condition(spec: JobSpec, runtime: int | None = None) -> dict[str, int]:
    """How long a job may run (`runtime` seconds, default compute.max_runtime_hours), and wait for
    capacity before it is stopped: compute.max_pending_minutes, or for a spot job (whose waits for
    spot capacity come and go) compute.max_wait_hours in all, plus what `runtime` adds."""
    compute = spec.compute
    ordinary = int(compute.max_runtime_hours * 3600)
    runtime = runtime or ordinary
    condition = {"MaxRuntimeInSeconds": runtime}
    if compute.spot:  # the runtime plus every wait for spot capacity (SageMaker: at least the runtime)
        condition["MaxWaitTimeInSeconds"] = int(compute.wait_hours * 3600) + runtime - ordinary
    else:
        condition["MaxPendingTimeInSeconds"] = max(MIN_PENDING_SECONDS, int(compute.max_pending_minutes * 60))
    return condition


def longest_seconds(request: JobRequest) -> int:
    """The longest a job of `request` can exist: its waits and its runtime (a spot job's
    MaxWaitTimeInSeconds holds both), for each try SageMaker's RetryStrategy allows."""
    spec = request.spec
    assert spec is not None, "cloud jobs always carry a spec"
    condition = stopping_condition(spec, runtime_seconds(request))
    each = condition.get("MaxWaitTimeInSeconds") or condition["MaxRuntimeInSeconds"] + condition[
        "MaxPendingTimeInSeconds"]
    return each * (1 + _retry_attempts(spec))


def _retry_attempts(spec: JobSpec) -> int:
    return min(MAX_RETRY_ATTEMPTS, max(1, spec.retries.max_retries))


def build_training_job_request(request: JobRequest, target: CloudTarget, role: str | None = None) -> dict[str, Any]:
    """`CreateTrainingJob` for one stage, run as `role` (by default its stage kind's, `CloudTarget.role_for`)."""
    spec = request.spec
    if spec is None:
        raise FatalError("a SageMaker job needs a job spec")
    channels = [_channel("spec", spec_url(target, request).rpartition("/")[0], "staging_url", mode="File")]
    if request.last_phase in ("train", "evaluate"):
        channels += [_channel("train", spec.data.train, "data.train"),
                     _channel("holdout", spec.data.holdout, "data.holdout")]
    if request.last_phase == "infer":
        channels.append(_channel("inference", spec.data.inference, "data.inference"))
    hyperparameters = {"phase": request.phase, "run-id": request.run_id}
    if request.checkpoint:
        hyperparameters["checkpoint"] = request.checkpoint
    return {
        "TrainingJobName": job_name(request, target.team, BASE_NAME_LENGTH),
        "RoleArn": role or target.role_for(request.last_phase),
        "AlgorithmSpecification": {
            "TrainingImage": target.image_for(spec),
            "TrainingInputMode": "File",
        },
        "HyperParameters": hyperparameters,
        "ResourceConfig": resource_config(spec, placement(request)[0]),
        "StoppingCondition": stopping_condition(spec, runtime_seconds(request)),
        # only the kinds whose role writes the run's checkpoint folder have SageMaker sync it
        **({"CheckpointConfig": _checkpoint_config(spec, request.run_id)}
           if STAGE_KINDS[request.last_phase] in ("preflight", "train") else {}),
        **({"EnableManagedSpotTraining": True} if spec.compute.spot else {}),
        # SageMaker retries a job that failed with an internal error itself; trnflow's own retries
        # (resubmissions) are for the failures SageMaker does not retry.
        "RetryStrategy": {"MaximumRetryAttempts": _retry_attempts(spec)},
        "InputDataConfig": channels,
        "OutputDataConfig": {"S3OutputPath": f"{target.staging_url.rstrip('/')}/{request.run_id}/output"},
        "Environment": container_environment(request, target),
        "Tags": [{"Key": k, "Value": v} for k, v in tags(request, target.team).items()],
    }
