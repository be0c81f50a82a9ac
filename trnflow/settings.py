"""Where trnflow keeps its own state, and how it polls: settings from TRNFLOW_* environment variables.

Job specs say what to run; these settings say where this machine keeps job folders.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TrnflowSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRNFLOW_", extra="ignore")

    home: Path = Field(Path(".trnflow"), description="Folder for local job directories and logs.")
    poll_seconds: float = Field(0.5, gt=0, description="How often a running job's state is polled.")
    image: str | None = Field(None, description="The training container image for SageMaker and Batch jobs.")
    staging_url: str | None = Field(
        None, description="s3:// prefix where cloud jobs get their spec and SageMaker writes its output."
    )
    sagemaker_role_arn: str | None = Field(None, description="The SageMaker execution role.")
    batch_job_queue: str | None = Field(None, description="The Batch job queue (with its fair-share policy).")

    def cloud_target(self, service: str):
        """Where cloud jobs go, from TRNFLOW_IMAGE, TRNFLOW_STAGING_URL and, for `service`,
        TRNFLOW_SAGEMAKER_ROLE_ARN or TRNFLOW_BATCH_JOB_QUEUE (the infra stack's outputs)."""
        from trnflow import aws
        from trnflow.backends.cloud import CloudTarget
        from trnflow.errors import FatalError

        if aws.emulated():  # `trnflow mock-aws`: its deployment has fixed names
            from trnflow.testing.mockcloud.provision import mock_outputs

            mock = mock_outputs()
            self = self.model_copy(update={k: getattr(self, k) or mock[k.upper()] for k in (
                "image", "staging_url", "sagemaker_role_arn", "batch_job_queue")})
        needed = {"image": self.image, "staging_url": self.staging_url}
        needed |= {"sagemaker_role_arn": self.sagemaker_role_arn} if service == "sagemaker" else {
            "batch_job_queue": self.batch_job_queue}
        missing = [f"TRNFLOW_{name.upper()}" for name, value in needed.items() if not value]
        if missing:
            raise FatalError(f"compute.backend {service} needs {', '.join(missing)}; set them from the outputs of "
                             "the CloudFormation stack in infra/")
        return CloudTarget(image=self.image, staging_url=self.staging_url, role_arn=self.sagemaker_role_arn or "",
                           job_queue=self.batch_job_queue or "")

    @property
    def jobs_dir(self) -> Path:
        return self.home.expanduser().resolve() / "jobs"
