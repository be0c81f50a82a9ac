"""Where trnflow keeps its own state, and how it polls: settings from TRNFLOW_* environment variables.

Job specs say what to run; these settings say where this machine keeps job folders.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

JOB_KINDS = ("preflight", "compile", "train", "infer")
"""The stage kinds: a cloud job runs as its kind's role (`role_<kind>` below, the stack's
`Job<Kind>Policy`, a run role's `job-<kind>` policy), which writes only that kind's outputs."""
STAGE_KINDS = {"sanity": "preflight", "collectives": "preflight", "compile": "compile", "train": "train",
               "evaluate": "train", "infer": "infer"}
"""Each phase's stage kind."""


class TrnflowSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRNFLOW_", extra="ignore")

    home: Path = Field(Path(".trnflow"), description="Folder for local job directories and logs.")
    poll_seconds: float = Field(0.5, gt=0, description="How often a running job's state is polled.")
    host_cpus: int | None = Field(
        None, ge=1, description="How many of this machine's CPUs the ranks of one job share for their tensor work "
        "(torch's intra-op threads, OMP_NUM_THREADS): each rank gets host_cpus // ranks threads, at least one. "
        "Unset: every CPU of the machine. Lower it where several jobs run on one machine at once (two pipelines, "
        "test processes): threads beyond the free CPUs wait for each other and slow every job. A spec's "
        "compute.threads_per_core overrides it.")
    image: str | None = Field(None, description="The training container image for SageMaker and Batch jobs of every "
                              "instance family, unless the image for a job's device is set below.")
    image_neuron: str | None = Field(None, description="The training image for the neuron device (TorchNeuron; trn2, "
                                     "trn3): jobs with compute.device neuron, or auto on those families.")
    image_xla: str | None = Field(None, description="The training image for the xla device (torch-xla; trn1): jobs "
                                  "with compute.device xla, or auto on trn1.")
    staging_url: str | None = Field(
        None, description="s3:// prefix where cloud jobs get their spec and SageMaker writes its output."
    )
    job_policies: str | None = Field(
        None, description="The IAM path of the stack's job policies (arn:aws:iam::<account>:policy/<prefix>/, its "
        "JobPolicies output). Set, every cloud job runs as a role made for it alone, which writes only its run's "
        "folders; the roles below are then not used.")
    role_settle_seconds: float = Field(
        10.0, ge=0, description="How long a job's new role is given to reach every IAM endpoint before the job "
        "is submitted.")
    sagemaker_role_arn: str | None = Field(
        None, description="Without job_policies: the role (SageMaker execution role, Batch job role) of every stage "
        "kind that has no role of its own below. Every run's jobs of a kind then share one role, and so one write "
        "scope.")
    role_preflight: str | None = Field(
        None, description="Without job_policies: the role sanity and collectives jobs run as (SageMaker execution "
        "role, Batch job role): it writes nothing but their results and the checkpoint round trip's `_preflight/` "
        "folder.")
    role_compile: str | None = Field(
        None, description="Without job_policies: the role compile jobs run as: the only one that writes the compile "
        "cache.")
    role_train: str | None = Field(
        None, description="Without job_policies: the role training and evaluation jobs run as: it writes "
        "checkpoints, never the registry.")
    role_infer: str | None = Field(
        None, description="Without job_policies: the role inference jobs run as: it writes embeddings, never the "
        "`_current.json` pointers that publish them.")
    batch_job_queue: str | None = Field(None, description="The Batch job queue (with its fair-share policy).")
    batch_spot_job_queue: str | None = Field(
        None, description="The Batch job queue of spot compute environments, for single-node specs with "
        "compute.spot (the stack's BatchSpotJobQueue output).")
    recipe_modules: bool = Field(
        False, description="Let a spec's model.recipe name any importable module as package.module:attr, "
        "not only an installed recipe. Importing a module runs its code, on this machine and in every job: "
        "turn it on only where every spec, and every module it can name, is trusted.")
    cache_signing_key: str | None = Field(
        None, description="The compile cache's signing key, for the compile stage alone: a PEM file (`trnflow cache "
        "keygen`), or the ARN of a Secrets Manager secret holding it, which only the compile stage's role can read. "
        "Cloud compile jobs are given an ARN, never a file.")
    cache_public_key: str | None = Field(
        None, description="The key every job checks compile cache entries with (`ed25519:<base64>`, as `trnflow "
        "cache keygen` prints it): set, only entries the compile stage signed are loaded. Not a secret.")
    cache_unsigned: bool = Field(
        False, description="Use a shared (s3://) compile cache whose entries are not signed. Without it, such a "
        "cache is refused unless cache_public_key is set: its entries are code every job runs, and anyone who "
        "can write the bucket can change them. Every run that uses it says so in its log and summary.")
    teams: str | None = Field(
        None, description="The stack's teams file (a path, or an s3:// object the operators alone write): every "
        "team, the prefixes its runs may reach, its cache and key, its tracking server. A run's team is decided "
        "by who starts it, never by its spec. Unset: the one the stack publishes, else one team, `default`, which "
        "may reach anywhere this machine's user can (docs/cloud.md, Teams).")
    mlflow_uri: str | None = Field(
        None, description="Where no teams are declared: the MLflow server whose credentials this machine holds "
        "(MLFLOW_TRACKING_TOKEN, or _USERNAME and _PASSWORD), the only one they are sent to. A run mirrored to "
        "any other server sends none. Declared teams name their own (docs/cloud.md, Teams).")
    parameters_path: str = Field(
        "/trnflow", description="Where the infra stack publishes the settings above as SSM parameters, "
        "read when they are not set here.")

    @property
    def jobs_dir(self) -> Path:
        return self.home.expanduser().resolve() / "jobs"
