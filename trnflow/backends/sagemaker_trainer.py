"""The SageMaker SDK's `ModelTrainer`, configured from a `CreateTrainingJob` request built by
`sagemaker_request`, so the request stays a pure, testable dict and the SDK does the sending.

The SDK is imported here only, when a job is submitted: importing it takes about 3 s.
"""

from __future__ import annotations

import os
from typing import Any

from trnflow import aws

TELEMETRY_OFF = {"SchemaVersion": "1.0", "SageMaker": {"PythonSDK": {"Modules": {"TelemetryOptOut": True}}}}
"""The SDK reports usage from a background thread unless told not to; trnflow tells it not to."""


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
    from sagemaker.core.training.configs import (
        CheckpointConfig,
        Compute,
        OutputDataConfig,
        RetryStrategy,
        StoppingCondition,
    )
    from sagemaker.train import ModelTrainer

    resources, checkpoint = body["ResourceConfig"], body["CheckpointConfig"]
    session = Session(boto_session=boto_session, default_bucket=default_bucket, sagemaker_config=TELEMETRY_OFF)
    trainer = ModelTrainer(
        sagemaker_session=session,
        role=body["RoleArn"],
        base_job_name=body["TrainingJobName"],
        training_image=body["AlgorithmSpecification"]["TrainingImage"],
        training_input_mode=body["AlgorithmSpecification"]["TrainingInputMode"],
        compute=Compute(instance_type=resources["InstanceType"], instance_count=resources["InstanceCount"],
                        volume_size_in_gb=resources["VolumeSizeInGB"]),
        stopping_condition=StoppingCondition(
            max_runtime_in_seconds=body["StoppingCondition"]["MaxRuntimeInSeconds"]),
        checkpoint_config=CheckpointConfig(s3_uri=checkpoint["S3Uri"], local_path=checkpoint["LocalPath"]),
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
    trainer = model_trainer(body, boto_session, default_bucket)
    trainer.train(wait=False, logs=False)
    return trainer._latest_training_job.training_job_name
