"""The SageMaker SDK's `ModelTrainer`, configured from a `CreateTrainingJob` request built by
`sagemaker_request`, so the request stays a pure, testable dict and the SDK does the sending.

The SDK is imported here only, when a job is submitted: importing it takes about 3 s.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from trnflow import aws

TELEMETRY_OFF = {"SchemaVersion": "1.0", "SageMaker": {"PythonSDK": {"Modules": {"TelemetryOptOut": True}}}}
"""The SDK reports usage from a background thread unless told not to; trnflow tells it not to."""


def _check_our_config_once() -> None:
    """Have the SDK check TELEMETRY_OFF against its config schema once per process, not at every
    lookup. The SDK checks a session's config each time it reads a value from it, a dozen times per
    submission, and each check first re-checks the whole schema: 0.45 CPU-s each, most of the cost
    of a submission. TELEMETRY_OFF never changes, so one check holds; any other config still goes
    through the SDK's own check every time. Without the SDK's hook (another SDK version), nothing
    changes but the cost."""
    from sagemaker.core.config.config_manager import SageMakerConfig  # the SDK: loaded for submissions only

    check = SageMakerConfig.__dict__.get("validate_sagemaker_config")
    if not isinstance(check, staticmethod) or getattr(check.__func__, "trnflow_checked", False):
        return
    check.__func__(TELEMETRY_OFF)  # the SDK's own check, once: a schema that refuses it fails here

    def validate_sagemaker_config(sagemaker_config: dict | None = None) -> None:
        if sagemaker_config is not TELEMETRY_OFF:
            check.__func__(sagemaker_config)

    validate_sagemaker_config.trnflow_checked = True  # type: ignore[attr-defined]
    SageMakerConfig.validate_sagemaker_config = staticmethod(validate_sagemaker_config)


def _channel(body: dict[str, Any]) -> Any:
    # The SageMaker SDK takes ~3 s and 200 MB to import: only a SageMaker submission loads it.
    from sagemaker.core.shapes import Channel, DataSource, S3DataSource

    s3 = body["DataSource"]["S3DataSource"]
    return Channel(channel_name=body["ChannelName"], input_mode=body["InputMode"], data_source=DataSource(
        s3_data_source=S3DataSource(s3_data_type=s3["S3DataType"], s3_uri=s3["S3Uri"],
                                    s3_data_distribution_type=s3["S3DataDistributionType"])))


def model_trainer(body: dict[str, Any], boto_session: Any, default_bucket: str) -> Any:
    """A ModelTrainer that sends `body` (its `TrainingJobName` is the base of the unique name)."""
    # The SageMaker SDK takes ~3 s and 200 MB to import: only a SageMaker submission loads it.
    from sagemaker.core.helper.session_helper import Session
    from sagemaker.core.shapes import InstancePreference
    from sagemaker.core.training.configs import (
        CheckpointConfig,
        Compute,
        OutputDataConfig,
        RetryStrategy,
        StoppingCondition,
    )
    from sagemaker.train import ModelTrainer

    _check_our_config_once()
    resources, checkpoint = body["ResourceConfig"], body.get("CheckpointConfig")
    session = Session(boto_session=boto_session, default_bucket=default_bucket, sagemaker_config=TELEMETRY_OFF)
    trainer = ModelTrainer(
        sagemaker_session=session,
        role=body["RoleArn"],
        base_job_name=body["TrainingJobName"],
        training_image=body["AlgorithmSpecification"]["TrainingImage"],
        training_input_mode=body["AlgorithmSpecification"]["TrainingInputMode"],
        compute=Compute(instance_type=resources.get("InstanceType"), instance_count=resources["InstanceCount"],
                        volume_size_in_gb=resources["VolumeSizeInGB"],
                        instance_preferences=[InstancePreference(instance_type=p["InstanceType"])
                                              for p in resources.get("InstancePreferences", [])] or None,
                        training_plan_arn=resources.get("TrainingPlanArn"),
                        enable_managed_spot_training=body.get("EnableManagedSpotTraining")),
        stopping_condition=StoppingCondition(
            max_runtime_in_seconds=body["StoppingCondition"]["MaxRuntimeInSeconds"],
            max_pending_time_in_seconds=body["StoppingCondition"].get("MaxPendingTimeInSeconds"),
            max_wait_time_in_seconds=body["StoppingCondition"].get("MaxWaitTimeInSeconds")),
        checkpoint_config=CheckpointConfig(s3_uri=checkpoint["S3Uri"], local_path=checkpoint["LocalPath"])
        if checkpoint else None,
        output_data_config=OutputDataConfig(s3_output_path=body["OutputDataConfig"]["S3OutputPath"]),
        input_data_config=[_channel(c) for c in body["InputDataConfig"]],
        environment=body["Environment"],
        hyperparameters=body["HyperParameters"],
        tags=[{"key": t["Key"], "value": t["Value"]} for t in body["Tags"]],
    )
    return trainer.with_retry_strategy(
        RetryStrategy(maximum_retry_attempts=body["RetryStrategy"]["MaximumRetryAttempts"]))


def submit(body: dict[str, Any], boto_session: Any, default_bucket: str) -> str:
    """Send the job; returns the training job's name (the base name plus a timestamp)."""
    if aws.emulated():  # the SDK checks the role with iam:SimulatePrincipalPolicy, which moto lacks
        os.environ["SAGEMAKER_VALIDATE_ROLE"] = "false"
    with warnings.catch_warnings():
        # The SDK's InstancePreference leaves its optional TrainingPlanArns as a sentinel that its own
        # serializer warns about on every submission; the request it sends omits the field, as it should.
        warnings.filterwarnings("ignore", message="Pydantic serializer warnings", category=UserWarning)
        trainer = model_trainer(body, boto_session, default_bucket)
        trainer.train(wait=False, logs=False)
    return trainer._latest_training_job.training_job_name
