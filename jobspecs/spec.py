"""The job spec: what to train, on what, and how to judge and use the result.

Every section forbids unknown keys and describes every field, so `trnflow schema` gives editors
completion and a typo is an error rather than a silently ignored setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zoneinfo
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, model_validator

from trnflow.redact import without_credentials
from trnflow.specs.instances import BILLED_BY, CATALOGUE, TRAINING_TYPES, instance, price
from trnflow.teams import is_loopback
from trnflow.urls import normalise_url

HOST_RESERVED_MEMORY_GIB = 12
"""Host memory each AWS Batch node keeps for the ECS agent and the OS, outside the job's container."""


def container_memory_limit_gib(instance_type: str) -> int:
    """The most memory a Batch container can reserve on `instance_type`: what the instance has, less
    HOST_RESERVED_MEMORY_GIB. Batch never places a job that asks for more: it waits in RUNNABLE."""
    return instance(instance_type).host_memory_gib - HOST_RESERVED_MEMORY_GIB


def memory_problem(instance_type: str, memory_gib: int) -> str | None:
    """What is wrong with a Batch container asking `memory_gib` GiB on `instance_type`, or None."""
    limit = container_memory_limit_gib(instance_type)
    if memory_gib <= limit:
        return None
    bigger = next((t for t in CATALOGUE.values()
                   if t.trainium and container_memory_limit_gib(t.name) >= memory_gib), None)
    fix = f" or pick {bigger.name} ({bigger.host_memory_gib} GiB)" if bigger else ""
    return (f"compute.memory_gib: {memory_gib} GiB is more than a {instance_type} container can have: the instance "
            f"has {instance(instance_type).host_memory_gib} GiB, less {HOST_RESERVED_MEMORY_GIB} GiB for the ECS agent "
            f"and the OS, which leaves {limit} GiB; set compute.memory_gib <= {limit}{fix}")


def sagemaker_checkpoint_problem(url: str) -> str | None:
    """What is wrong with `url` as a SageMaker job's checkpoint folder, or None. SageMaker copies
    `CheckpointConfig.S3Uri` into the container and back, and only from S3: a local folder would be
    on an instance that is gone when the job is retried or resubmitted."""
    if url.startswith("s3://"):
        return None
    return (f"train.checkpoint_url: {url} is not on S3; a SageMaker job keeps its checkpoints in an s3:// folder "
            "(CheckpointConfig.S3Uri), where a retried or resubmitted job resumes from them: set "
            "train.checkpoint_url to s3://<bucket>/<prefix>, or run with compute.backend: local")


def cloud_location_problems(backend: str, locations: dict[str, str | None]) -> list[str]:
    """What is wrong with each location (by spec field) for a job on `backend`: a SageMaker or Batch
    job runs on hosts that see S3, never this machine's folders, so every location it reads or
    writes must be an s3:// URL. Empty for the local backend."""
    if backend == "local":
        return []
    service = {"sagemaker": "SageMaker", "batch": "AWS Batch"}[backend]
    problems = []
    for field, url in locations.items():
        if url is None or url == "champion" or url.startswith("s3://"):
            continue
        if field == "train.checkpoint_url" and backend == "sagemaker":
            problems.append(sagemaker_checkpoint_problem(url) or "")
        else:
            problems.append(f"{field}: {url} is not on S3; {service} jobs run on hosts that cannot see this "
                            f"machine's files. Upload it (or let the job write) to s3://<bucket>/<prefix> and set "
                            f"{field} there, or run with compute.backend: local")
    return problems


Url = Annotated[str, AfterValidator(normalise_url)]
ChampionOrUrl = Annotated[Literal["champion"] | Url, Field(union_mode="left_to_right")]
"""`champion` (the registry's current champion for this spec's name) or a location."""


MAX_STEPS = 10**9
"""More optimizer steps than any run takes: a bound a step counter and its arithmetic honour."""
XLA_TP = ("train.parallelism.tp does not run on the xla device (trn1, through torch-xla), which trnflow does not "
          "split; use tp: 1 there, or compute.device: neuron (trn2, trn3) or emulator")
XLA_FSDP = ("train.parallelism.strategy: fsdp does not run on the xla device (trn1, through torch-xla), which "
            "shards with its own SPMD-based FSDP that trnflow does not drive; use ddp (or auto, which refuses what "
            "ddp cannot fit) on trn1, or the neuron device on trn2 and trn3")
"""Why sharded training is refused on torch-xla."""
BATCH_SPOT_TYPES = ("trn1.32xlarge",)
"""The instance types of the infra stack's Batch spot compute environment: one, because Batch places
a single-node job by its vCPUs and memory, so a smaller spec could land on a larger type."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""An installed recipe's name, as entry points are named (`m5-text`, `tabular-mlp`)."""
METRIC_NAME = r"^[a-z][a-z0-9_]*$"
"""A metric's name (`gate.metric`, `gate.metrics`): lower-case letters, digits and underscores."""
MODULE_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""`package.module:Class`: a recipe named by where it is, imported only where TRNFLOW_RECIPE_MODULES allows."""


def is_module_reference(recipe: str) -> bool:
    """Whether model.recipe names a module (`package.module:attr`) rather than an installed recipe."""
    return ":" in recipe


def _recipe_reference(value: str) -> str:
    if is_module_reference(value):
        if not MODULE_REFERENCE.match(value):
            raise ValueError(f"{value!r} is not package.module:attr: write the module's dotted name (letters, digits "
                             "and underscores, no leading dot), a colon, then the recipe class's name")
    elif not RECIPE_NAME.match(value):
        raise ValueError(f"{value!r} is not a recipe's name; `trnflow recipes` lists the installed ones")
    return value


class ModelSpec(Section):
    """Which model the pipeline trains: a recipe and its settings."""

    recipe: Annotated[str, AfterValidator(_recipe_reference)] = Field(
        "m5-text", min_length=1, max_length=200,
        description="The model recipe: an installed recipe's name (`trnflow recipes` lists them; m5-text is "
        "built in), or package.module:attr where TRNFLOW_RECIPE_MODULES=1 allows importing modules by name "
        "(which runs their code).")
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="The recipe's settings, checked against its parameters (`trnflow recipes` lists them with "
        "their defaults); unset ones take the defaults.")

    @model_validator(mode="before")
    @classmethod
    def _recipe_and_params(cls, data: Any) -> Any:
        """A spec from before recipes had the model's settings directly under `model:`: say how to
        write it now, with its own values."""
        if isinstance(data, dict) and (stray := [k for k in data if k not in ("recipe", "params")]):
            old = {k: data[k] for k in stray}
            recipe = data.get("recipe", "m5-text")
            params = data.get("params") if isinstance(data.get("params"), dict) else {}
            raise ValueError(
                f"model.params: {', '.join(stray)} are the recipe's settings and go under model.params, with "
                f"model.recipe beside them; write  model: "
                f"{json.dumps({'recipe': recipe, 'params': {**params, **old}}, default=str)}")
        return data


class DataSpec(Section):
    """Where the data lives and how to read it."""

    train: Url = Field(description="Training data: a file or a directory (optionally of dt=YYYY-MM-DD parts).")
    holdout: Url = Field(description="Holdout data used by the evaluation gate.")
    inference: Url = Field(description="Rows to embed in the batch-inference stage.")
    format: Literal["jsonl", "parquet", "csv", "amazon-polarity"] = Field(
        "jsonl",
        description="File format of all three sets. amazon-polarity is the headerless CSV layout "
        "label (1 negative, 2 positive), title, content; its rows are identified as <file>:<row>.",
    )
    window: Literal["all", "since-watermark"] = Field(
        "all",
        description="Which training partitions a run reads: all, or only the dt=YYYY-MM-DD partitions after "
        "the watermark of the checkpoint it starts from (incremental training).",
    )
    ready_marker: str | None = Field(
        None,
        description="A file, such as _SUCCESS, whose presence in a dt=YYYY-MM-DD folder of the training data "
        "marks that day as complete: training reads, and retraining looks for, only days that have it, so "
        "a day still being written is left for a later run. None: every day is read as soon as it appears.",
        pattern=r"^[A-Za-z0-9._-]+$",
    )
    text_field: str = Field("text", description="Column holding the input text.")
    label_field: str = Field("label", description="Column holding the integer class label.")
    id_field: str = Field("id", description="Column holding a unique row id (used by inference output).")


class ComputeSpec(Section):
    """Where the job runs."""

    backend: Literal["local", "sagemaker", "batch"] = Field(
        "local", description="local (the NeuronCore emulator), sagemaker or batch."
    )
    instance_type: Literal[TRAINING_TYPES] = Field(  # type: ignore[valid-type]
        "trn1.2xlarge", description="Trainium instance type (the emulator mirrors its topology)."
    )
    instance_preferences: list[Literal[TRAINING_TYPES]] = Field(  # type: ignore[valid-type]
        [], max_length=5,
        description="Instance types to try in turn, the most wanted first, when one has no capacity; "
        "compute.instance_type is the first of them (leave it unset, or set it to the first). Each must take the "
        "job as the first does (cores, nodes, device, memory) and run the same training image (one family: trn1 "
        "and trn1n, or trn2). SageMaker picks the first with capacity (ResourceConfig.InstancePreferences); "
        "on Batch a job still waiting for capacity after compute.max_pending_minutes is resubmitted for the next. "
        "The run records the type it got and is priced by it.",
    )
    training_plan: str | None = Field(
        None, pattern=r"^arn:aws[a-z-]*:sagemaker:[a-z0-9-]+:\d{12}:training-plan/[A-Za-z0-9-]{1,64}$",
        description="SageMaker: the ARN of a training plan (reserved capacity) the jobs run on "
        "(ResourceConfig.TrainingPlanArn). Its instance type must be compute.instance_type.",
    )
    nodes: int = Field(1, ge=1, le=512, description="Number of instances.")
    cores_per_node: int = Field(2, ge=1, le=256, description="NeuronCores used per instance, one worker process each.")
    device: Literal["auto", "emulator", "neuron", "xla"] = Field(
        "auto", description="What runs the job's tensors: neuron (native TorchNeuron, trn2/trn3), xla (torch-xla, "
        "trn1), emulator (the NeuronCore emulator, any machine), or auto: the one the instance family and the "
        "installed Neuron SDK allow, else the emulator.",
    )
    threads_per_core: int | None = Field(
        None, ge=1, le=256, description="Host CPU threads each core's worker process uses (torch's intra-op threads; "
        "on the emulator they do the tensor work). None: the host's CPUs shared evenly between the node's cores. "
        "When set, and the node's workers fit in the host's CPUs, each worker is pinned to CPUs of its own, "
        "chosen by its core, so jobs on different cores of one host do not share CPUs either.",
    )
    precision: Literal["fp32", "bf16", "bf16-rne", "bf16-sr"] = Field(
        "fp32", description="fp32; bf16 autocast over fp32 master weights (bf16); or pure bf16, weights and optimizer "
        "state held in bf16 and rounded after each update to nearest even (bf16-rne) or stochastically (bf16-sr, "
        "as Trainium does with NEURON_RT_STOCHASTIC_ROUNDING_EN=1).",
    )
    max_runtime_hours: float = Field(
        24.0, gt=0, le=28 * 24, description="A cloud job still running after this long is stopped (per attempt)."
    )
    hang_timeout_minutes: float = Field(
        30.0, gt=0, le=24 * 60,
        description="A rank that makes no progress (no training step, inference shard, collective or compiled "
        "program) for this long is ended as stalled, naming its rank and host; the failure is transient, so the "
        "stage is retried and resumes from its last checkpoint. The first interval includes the rank's start and "
        "any compilation its first step needs.",
    )
    max_pending_minutes: float = Field(
        60.0, gt=0, le=28 * 24 * 60,
        description="How long a job may wait for its instances before it is stopped as a capacity failure (which "
        "is retried): on SageMaker its StoppingCondition.MaxPendingTimeInSeconds (30 minutes at least there; a "
        "spot job's waits are bounded by compute.max_wait_hours instead); on Batch a job still RUNNABLE after "
        "this long is cancelled, naming its queue and instance type; locally a job waits this long for "
        "NeuronCores another run holds, saying which run holds them.",
    )
    spot: bool = Field(
        False,
        description="Run on spot capacity, which costs less and can be reclaimed: SageMaker's managed spot "
        "training (EnableManagedSpotTraining; not with compute.instance_preferences). On the reclaim notice "
        "(SIGTERM, about two minutes ahead), training writes a checkpoint at the next step boundary and the job "
        "ends as transient, so the retry resumes from that checkpoint. On AWS Batch, a one-node spec's jobs run as "
        "single-node jobs on the deployment's spot queue (TRNFLOW_BATCH_SPOT_JOB_QUEUE), and the container reads "
        "the notice from the instance metadata service; Batch cannot run multi-node jobs on spot compute "
        "environments, so a Batch spec with more nodes is refused.",
    )
    max_wait_hours: float | None = Field(
        None, gt=0, le=28 * 24,
        description="Spot on SageMaker: how long a job may take in all, waiting for spot capacity and interruptions "
        "included (its MaxWaitTimeInSeconds); at least compute.max_runtime_hours. None: twice max_runtime_hours. "
        "On Batch, compute.max_pending_minutes bounds each wait for capacity instead.",
    )
    volume_gb: int = Field(200, ge=1, le=16384, description="Local disk per instance for SageMaker jobs (GB).")
    price_per_hour: float | None = Field(
        None, ge=0, le=100_000,
        description="USD per instance-hour for the cost table; default: the catalogue's on-demand price for the "
        "service that runs the jobs (SageMaker's ml.* price for sagemaker, EC2's for batch and local)."
    )
    max_cost_usd: float | None = Field(
        None, gt=0, le=10_000_000,
        description="The run's budget (USD, at the cost table's prices). A run forecast to cost more (`trnflow plan`) "
        "is refused before its first job, unless launched with --override-forecast REASON. While it trains, at each "
        "logged step the cost spent so far plus the forecast for what remains is checked against it: training that "
        "would exceed it checkpoints and stops, ending the run in the state OverBudget; rerunning with the same "
        "--run-id and a higher budget resumes it. None: no budget. Needs a price (compute.price_per_hour where the "
        "catalogue has none).",
    )
    share_identifier: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_]{1,255}$",
        description="Batch fair-share identifier (for queues with a fair-share scheduling policy), e.g. a team.",
    )
    scheduling_priority: int = Field(
        0, ge=0, le=9999, description="Batch scheduling priority within a fair-share queue (higher runs first), "
        "for a run of a stack that declares no teams and a spec that names no compute.priority_class; otherwise "
        "the class's priority is used, and a declared team's spec may not set it."
    )
    priority_class: str | None = Field(
        None, pattern=r"^[a-z0-9][a-z0-9-]{0,39}$",
        description="The run's priority class (`production`, `experiment`, or a class of the stack's teams file), "
        "which its team must be allowed: its Batch jobs get the class's scheduling priority, which orders them "
        "within their share of a fair-share queue. None: the lowest class the team may use.",
    )
    fair_share: bool | None = Field(
        None,
        description="Batch: whether the job queue (TRNFLOW_BATCH_JOB_QUEUE) has a fair-share scheduling policy, as "
        "the infra stack's queue does. Batch refuses a job without a share identifier on such a queue, and one "
        "with a share identifier on any other: true needs compute.share_identifier, false refuses it. None: not "
        "declared; the queue itself is checked before the first job is submitted.",
    )
    memory_gib: int | None = Field(
        None, ge=1, le=65536,
        description="Batch: host memory (GiB) each node's container reserves. None: all the instance type has, "
        "less 12 GiB for the ECS agent and the OS. More is refused: no instance could place the job, which would "
        "wait in RUNNABLE for ever.",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.cores_per_node

    @property
    def hourly_price(self) -> float | None:
        """USD per instance-hour: price_per_hour, else the catalogue's on-demand price for the service
        that bills the backend's instances; None when neither is known."""
        if self.price_per_hour is not None:
            return self.price_per_hour
        found = price(BILLED_BY[self.backend], self.instance_type)
        return None if found is None else found.usd_per_hour

    @property
    def container_memory_gib(self) -> int:
        """The memory each Batch node's container reserves: memory_gib, else all it can have."""
        return self.memory_gib or container_memory_limit_gib(self.instance_type)

    @property
    def instance_choices(self) -> list[str]:
        """The instance types a job may run on, the most wanted first."""
        return list(self.instance_preferences) or [self.instance_type]

    @model_validator(mode="before")
    @classmethod
    def _first_preference_is_the_type(cls, data: Any) -> Any:
        """compute.instance_type left unset, with preferences: the first of them."""
        if isinstance(data, dict) and data.get("instance_preferences") and "instance_type" not in data:
            wanted = data["instance_preferences"]
            if isinstance(wanted, list) and wanted:
                return {**data, "instance_type": wanted[0]}
        return data

    @model_validator(mode="after")
    def _preferences_agree(self) -> ComputeSpec:
        wanted = self.instance_preferences
        if not wanted:
            return self
        if self.instance_type != wanted[0]:
            raise ValueError(f"compute.instance_type: {self.instance_type} is not the first of "
                             f"compute.instance_preferences ({wanted[0]}); leave it unset, or set it to {wanted[0]}")
        if len(set(wanted)) < len(wanted):
            raise ValueError("compute.instance_preferences: an instance type is listed twice; list each once")
        if len({instance(t).native_torch for t in wanted}) > 1:
            raise ValueError(f"compute.instance_preferences: {', '.join(wanted)} mix trn1 with trn2, which run "
                             "different training images; one job runs one image, so list one family only")
        if self.training_plan:
            raise ValueError("compute.training_plan: a training plan reserves one instance type; remove "
                             "compute.instance_preferences, or the training plan")
        for other in wanted[1:]:
            self._takes_the_job(other, "compute.instance_preferences")
        return self

    @model_validator(mode="after")
    def _fits_instance(self) -> ComputeSpec:
        return self._takes_the_job(self.instance_type, "compute")

    def _takes_the_job(self, name: str, where: str) -> ComputeSpec:
        """Refuse an instance type that cannot run the job as specified (`where` names the field
        that chose it, for an alternative in compute.instance_preferences)."""
        itype = instance(name)
        also = f" ({where} lists it)" if where != "compute" else ""
        drop = f", or remove {itype.name} from {where}" if also else ""
        if self.cores_per_node > itype.cores:
            bigger = next((t.name for t in CATALOGUE.values() if t.trainium and t.cores >= self.cores_per_node),
                          None)
            fix = f" or pick {bigger}" if bigger and not also else ""
            raise ValueError(
                f"compute.cores_per_node: {itype.name}{also} has {itype.cores} NeuronCores; "
                f"set compute.cores_per_node <= {itype.cores}{fix}{drop}"
            )
        if self.device == "neuron" and not itype.native_torch:
            raise ValueError(
                f"compute.device: neuron (native TorchNeuron) runs on trn2 and later, not on {itype.name}{also} "
                f"(NeuronCore-{itype.neuroncore_version}), which runs the xla device: set compute.device to xla or auto"
                f"{drop}"
            )
        if self.nodes > 1 and not itype.multi_node:
            raise ValueError(
                f"compute.nodes: {itype.name}{also} has no EFA for multi-node training; set compute.nodes: 1 "
                f"or pick trn1.32xlarge, trn1n.32xlarge or trn2.48xlarge{drop}"
            )
        return self

    @property
    def wait_hours(self) -> float:
        """Spot: how long a job may take in all (compute.max_wait_hours, else twice max_runtime_hours)."""
        return self.max_wait_hours or min(28 * 24, 2 * self.max_runtime_hours)

    @model_validator(mode="after")
    def _spot_as_the_services_allow(self) -> ComputeSpec:
        if self.max_wait_hours is not None and not self.spot:
            raise ValueError("compute.max_wait_hours: it bounds a spot job's waits; set compute.spot: true, or "
                             "remove it")
        if self.spot and self.wait_hours < self.max_runtime_hours:
            raise ValueError(f"compute.max_wait_hours: {self.wait_hours:g} is less than compute.max_runtime_hours "
                             f"({self.max_runtime_hours:g}); a spot job's waits come on top of its runtime, so set "
                             "it to the runtime or more")
        if self.spot and self.backend == "sagemaker" and self.instance_preferences:
            raise ValueError("compute.spot: SageMaker's instance preferences take on-demand capacity only; remove "
                             "compute.instance_preferences, or compute.spot")
        if self.spot and self.backend == "batch" and self.instance_type not in BATCH_SPOT_TYPES:
            raise ValueError(f"compute.instance_type: Batch spot jobs run on the deployment's spot compute "
                             f"environment, which holds {', '.join(BATCH_SPOT_TYPES)} (one job to an instance: Batch "
                             f"places a single-node job by its vCPUs and memory, not by type), not "
                             f"{self.instance_type}; set compute.instance_type: {BATCH_SPOT_TYPES[0]}, or run spot "
                             "on sagemaker")
        if self.spot and self.backend == "batch" and self.nodes > 1:
            raise ValueError(f"compute.spot: AWS Batch does not run multi-node parallel jobs on spot compute "
                             f"environments, and this spec asks for {self.nodes} nodes; set compute.nodes: 1 (a "
                             "single-node job runs on the spot queue), run spot on sagemaker, or set compute.spot: "
                             "false")
        if self.max_wait_hours is not None and self.backend == "batch":
            raise ValueError("compute.max_wait_hours: it is SageMaker's MaxWaitTimeInSeconds; on Batch each wait for "
                             "spot capacity is bounded by compute.max_pending_minutes, so remove it")
        return self

    @model_validator(mode="after")
    def _plans_are_sagemakers(self) -> ComputeSpec:
        if self.training_plan and self.backend != "sagemaker":
            raise ValueError(f"compute.training_plan: training plans are SageMaker's, and compute.backend is "
                             f"{self.backend}; remove compute.training_plan, or run on sagemaker")
        return self

    @model_validator(mode="after")
    def _pending_as_the_service_allows(self) -> ComputeSpec:
        if self.backend == "sagemaker" and not self.spot and self.max_pending_minutes < 30:
            raise ValueError(
                f"compute.max_pending_minutes: {self.max_pending_minutes:g} is below SageMaker's least "
                "MaxPendingTimeInSeconds (1800 s); set 30 or more")
        return self

    @model_validator(mode="after")
    def _fits_memory(self) -> ComputeSpec:
        problem = self.memory_gib and memory_problem(self.instance_type, self.memory_gib)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _share_identifier_as_the_queue_needs(self) -> ComputeSpec:
        """A fair-share queue refuses a job without a share identifier, any other queue one with it."""
        if self.fair_share and not self.share_identifier:
            raise ValueError(
                "compute.share_identifier: compute.fair_share says the Batch job queue has a fair-share scheduling "
                "policy, which refuses every job without a share identifier (shareIdentifier must be specified); "
                "set compute.share_identifier, for example to a team name in the policy's shareDistribution")
        if self.fair_share is False and self.share_identifier:
            raise ValueError(
                "compute.share_identifier: compute.fair_share: false says the Batch job queue has no fair-share "
                "scheduling policy, and Batch refuses a share identifier on such a queue; remove "
                "compute.share_identifier, or set compute.fair_share: true if the queue has one")
        return self


def default_cache_url() -> str:
    """`$XDG_CACHE_HOME/trnflow/neuron-compile-cache` (`~/.cache` when unset): a folder of the user's
    own, where no other user can put entries."""
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return normalise_url(str(Path(base) / "trnflow" / "neuron-compile-cache"))


default_cache_url.shown = "$XDG_CACHE_HOME/trnflow/neuron-compile-cache (~/.cache/... when unset)"  # type: ignore[attr-defined]


class CompileSpec(Section):
    """Ahead-of-time compilation into the persistent compile cache."""

    optlevel: Literal[1, 2, 3] = Field(2, description="Compiler optimisation level, as neuronx-cc --optlevel.")
    cache_url: Url = Field(
        default_factory=default_cache_url,
        description="Persistent compile cache: a directory or s3:// URL, shared by every job and host that uses it. "
        "A local folder must be yours and not writable by others (what it holds runs in every job); a cache "
        "shared on S3 should be written by the compile stage alone, with signed entries.",
    )
    workers: int = Field(1, ge=1, le=64, description="Parallel compile processes.")
    max_recompiles: int | None = Field(
        None, ge=0, le=1_000_000,
        description="Stop a training, evaluation or inference run when it meets more graphs than this that were "
        "not compiled ahead of time (recompilations, usually from a changed input shape), on any device; each one "
        "is logged with the shapes that caused it. None: no limit; 0: stop at the first.",
    )
    fail_on_recompile: bool = Field(
        False, description="Stop at the first recompilation: the same as compile.max_recompiles: 0.",
    )

    @property
    def recompile_limit(self) -> int | None:
        """The recompilations a run may make; None: any number."""
        return 0 if self.fail_on_recompile else self.max_recompiles

    @model_validator(mode="after")
    def _one_limit(self) -> CompileSpec:
        if self.fail_on_recompile and self.max_recompiles:
            raise ValueError(f"compile.fail_on_recompile: true stops at the first recompilation, but "
                             f"compile.max_recompiles is {self.max_recompiles}; set only one of them")
        return self


class ParallelismSpec(Section):
    """How the model is spread over the job's NeuronCores."""

    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto",
        description="ddp: every core holds the whole model, its gradients and optimizer state, and the batch is "
        "split (data parallel). fsdp: each core holds 1/N of the weights, gradients and optimizer state "
        "(PyTorch FSDP2, fully_shard, per block as the recipe declares its blocks) and gathers a block's weights "
        "only while it computes, for models that do not fit one core. auto: ddp when the per-core estimate fits "
        "the instance's core memory, else fsdp; `trnflow validate` prints the figures of both.",
    )
    tp: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        1,
        description="Tensor parallelism: each attention and MLP projection of the model is split over this many "
        "cores of one node (column-parallel, then row-parallel, the attention heads divided among them), which "
        "then run every batch together; the job's cores form tp-sized groups, and the batch is split over the "
        "groups (ddp or fsdp over them, as `strategy` says). It must divide compute.cores_per_node and the "
        "model's attention heads; the recipe must declare how its layers split (hf-causal-lm's Llama-style "
        "decoders, hf-encoder's BERT-style encoders). auto: the memory planner's choice, the smallest tp at which "
        "the model fits (see docs/parallelism.md). 1: no tensor parallelism.",
    )

    @property
    def tp_degree(self) -> int:
        """The cores each layer is split over: `tp`, with `auto` not yet decided taken as 1 (the memory
        planner decides it before any job starts: `trnflow.workload.memory.decided`)."""
        return 1 if self.tp == "auto" else self.tp

    min_cores_per_node: int | None = Field(
        None, ge=1, le=64,
        description="On the local backend, after a hardware error leaves the instance fewer healthy cores than "
        "compute.cores_per_node, later attempts train on as many as are left, down to this many (the most that "
        "divide train.global_batch_size), resuming from the last checkpoint resharded over them. Null: an attempt "
        "always needs compute.cores_per_node healthy cores. (A cloud retry gets new instances with every core.)",
    )


class TrainSpec(Section):
    """Incremental training from a checkpoint."""

    steps: int = Field(ge=1, le=MAX_STEPS, description="Optimizer steps in this run.")
    global_batch_size: int = Field(ge=1, le=2**24, description="Samples per step across all NeuronCores.")
    lr: float = Field(1e-3, gt=0, le=10,
                      description="Learning rate of the recipe's optimizer (AdamW unless the recipe says otherwise).")
    weight_decay: float = Field(0.01, ge=0, le=10,
                                description="Weight decay of the recipe's optimizer (AdamW's by default).")
    max_minutes: float | None = Field(
        None, gt=0, le=28 * 24 * 60,
        description="The training stage's deadline: minutes from its start by which it should end. A run whose "
        "training is forecast to take longer (`trnflow plan`) is refused before its first job, unless launched with "
        "--override-forecast REASON. While it trains, each logged step recomputes the time left from the steps so "
        "far (the progress bar's ETA); once the stage would end after its deadline, it says so at once, as a warning "
        "in the run's log and its Prefect state message (the state named DeadlineAtRisk), and trains on. None: no "
        "deadline.",
    )
    max_cost_usd: float | None = Field(
        None, gt=0, le=10_000_000,
        description="The most the training stage may cost (USD, at the cost table's prices). Checked at each logged "
        "step: the cost spent since training started plus the forecast for the steps left; training that would "
        "exceed it checkpoints and stops (OverBudget). With compute.max_cost_usd, training's job gets the less of "
        "this and what the run's budget leaves (less what the run spent before training and the forecast of the "
        "stages after it); the spec keeps what was written. Set it to bound training alone.",
    )
    checkpoint_every: int = Field(100, ge=1, le=MAX_STEPS, description="Save a checkpoint every this many steps.")
    checkpoint_url: Url = Field(description="Where checkpoints are written: a directory or s3:// URL.")
    init_from: ChampionOrUrl | None = Field(
        None,
        description="Checkpoint to start from: `champion` (the registered champion of this job's name, from "
        "registry_url; scratch if there is none yet), a trnflow checkpoint folder (its tokenizer and data "
        "watermark come with it) or a plain PyTorch state_dict file. None starts from scratch.",
    )
    keep_latest: int | None = Field(
        3, ge=1, le=100_000, description="Committed checkpoints kept per run (older ones are deleted); none keeps all."
    )
    seed: int = Field(1234, ge=0, le=2**63 - 1,
                      description="Seed for weights, data order and dropout (torch takes up to 2**63 - 1).")
    log_every: int = Field(10, ge=1, le=MAX_STEPS, description="Log loss and throughput every this many steps.")
    drop_last: bool = Field(
        True,
        description="Drop each epoch's last partial batch so every step has the same shape, as Trainium needs. "
        "false trains on it too: a smaller batch, which recompiles the training graph.",
    )
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec,
                                         description="How the model is spread over the job's cores.")


class RetrySpec(Section):
    """How transient failures (lost cores, timeouts, capacity) are retried. Bad specs never are."""

    max_retries: int = Field(2, ge=0, le=10, description="Retries of a stage after a transient failure.")
    backoff_seconds: float = Field(10.0, ge=0, le=3600, description="First retry delay; doubles each retry.")
    jitter: float = Field(0.5, ge=0, le=1, description="Random fraction added to each delay.")


ABS_DIFF = 0.001
"""The gate's band when a spec sets none: within 0.1% (the M5 rule)."""


class GateSpec(Section):
    """The parity gate: candidate against reference, within max_abs_diff (or max_rel_diff)."""

    reference: ChampionOrUrl | None = Field(
        None,
        description="What the candidate is compared with: a metrics JSON file (a previous run's, or another "
        "platform's such as a GPU run), or `champion` (the registered champion's series). None records a "
        "baseline only.",
    )
    metric: str = Field(
        "accuracy", pattern=METRIC_NAME,
        description="Metric compared by the gate: any metric the recipe declares (`trnflow recipes` lists them, "
        "with which way each is better). Against the champion the candidate may be better by any amount.",
    )
    max_abs_diff: float | None = Field(
        None, gt=0, lt=1,
        description="Largest allowed |candidate - reference|: 0.001 (the M5 rule's 0.1%) unless max_rel_diff is set.",
    )
    max_rel_diff: float | None = Field(
        None, gt=0, lt=1,
        description="Largest allowed |candidate - reference| as a share of the reference's value (0.01: 1%), for "
        "metrics such as perplexity where an absolute band means little. Replaces max_abs_diff; set one of them.",
    )
    mode: Literal["every-point", "final"] = Field(
        "every-point",
        description="every-point: each evaluation step both series share must be within max_abs_diff (the M5 "
        "rule); final: only the last shared step.",
    )
    eval_every: int | None = Field(
        None, ge=1, le=MAX_STEPS,
        description="Evaluate on the holdout set every this many training steps (and always at the end)."
    )
    metrics: list[Annotated[str, StringConstraints(pattern=METRIC_NAME)]] = Field(
        default_factory=lambda: ["loss"],
        description="Metrics recorded beside accuracy (and the gate's metric) at each evaluation point: any the "
        "recipe declares.",
    )
    significance: float = Field(
        0.05, gt=0, lt=1, description="Level of the paired McNemar test on per-example predictions."
    )
    fail_on_significant: bool = Field(
        False,
        description="Also fail the gate when McNemar's test finds the candidate and reference differ, even "
        "within max_abs_diff (by default that is reported as a warning). The test pairs per-row correctness, "
        "so it runs when the gate's metric is accuracy.",
    )

    @model_validator(mode="before")
    @classmethod
    def _absolute_unless_relative(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("max_rel_diff") is None and data.get("max_abs_diff") is None:
            return {**data, "max_abs_diff": ABS_DIFF}
        return data

    @model_validator(mode="after")
    def _one_band(self) -> GateSpec:
        if self.max_rel_diff is not None and self.max_abs_diff is not None:
            raise ValueError("gate.max_rel_diff: max_abs_diff is set too; the gate uses one band, so keep "
                             "max_abs_diff for an absolute band or max_rel_diff for a relative one")
        return self


class GenerateSpec(Section):
    """Text generation in batch inference, for a recipe that generates (hf-causal-lm): each row's
    completion of its prompt, written beside what the recipe publishes."""

    max_new_tokens: int = Field(32, ge=1, le=4096, description="Tokens generated per row at most (a row stops at its "
                                "end-of-sequence token).")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy (the most likely token each time); "
                               "above 0: sampled from the probabilities at this temperature.")
    top_k: int | None = Field(None, ge=1, le=1_000_000, description="When sampling: only from the k most likely "
                              "tokens.")
    seed: int = Field(0, ge=0, lt=2**63, description="When sampling: with the row's id, seeds its draws, so a rerun or "
                      "a resumed shard writes the same completions.")


class InferenceSpec(Section):
    """Offline batch inference: embeddings written as Parquet shards."""

    output_url: Url = Field(description="Directory or s3:// URL for the Parquet shards.")
    shard_size: int = Field(10_000, ge=1, le=100_000_000, description="Rows per output shard.")
    batch_size: int = Field(256, ge=1, le=2**20, description="Rows per forward pass.")
    generate: GenerateSpec | None = Field(None, description="Also generate each row's completion (hf-causal-lm), "
                                          "greedy unless a temperature is set.")


class ScheduleSpec(Section):
    """When scheduled incremental retraining runs."""

    cron: str = Field(
        description="Five-field cron expression, for example '0 3 * * *'. Read by scheduled retraining; "
        "`trnflow run` runs at once and ignores it."
    )
    timezone: str = Field("UTC", description="IANA time zone for the cron expression.")

    @model_validator(mode="after")
    def _five_fields(self) -> ScheduleSpec:
        fields = self.cron.split()
        if len(fields) != 5:
            raise ValueError(f"schedule.cron: {self.cron!r} must have 5 fields (minute hour day month weekday)")
        for text, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
            problem = _cron_field_problem(text, low, high, names)
            if problem:
                raise ValueError(f"schedule.cron: {self.cron!r}: the {name} field {text!r} {problem}; "
                                 f"it takes {low}-{high}, *, lists (a,b), ranges (a-b) and steps (*/n)")
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder such as "Europe"
            raise ValueError(f"schedule.timezone: {self.timezone!r} is not an IANA time zone; use for example "
                             "UTC or Europe/Paris") from None
        return self


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day", 1, 31, ()), ("month", 1, 12, _MONTHS),
                ("weekday", 0, 7, _DAYS))


def _cron_field_problem(text: str, low: int, high: int, names: tuple[str, ...]) -> str | None:
    """What is wrong with one cron field, or None."""
    if any(sign in text.upper() for sign in "LW#?"):
        return None  # last day, nearest weekday, n-th weekday, no value: the scheduler checks those
    for item in text.split(","):
        span, _, step = item.partition("/")
        if step and not (step.isdigit() and int(step) >= 1):
            return f"has step {step!r}, not a positive number"
        if span == "*":
            continue
        for bound in span.split("-", 1):
            value = names.index(bound.lower()) + (low if names is _MONTHS else 0) if bound.lower() in names else (
                int(bound) if bound.isdigit() else None)
            if value is None:
                return f"has {bound!r}, which is not a number"
            if not low <= value <= high:
                return f"has {value}, outside {low}-{high}"
    return None


MLFLOW_ARN = re.compile(r"^arn:aws[a-z-]*:sagemaker:[a-z0-9-]+:[0-9]{12}:mlflow-(app|tracking-server)/"
                        r"[A-Za-z0-9](-*[A-Za-z0-9]){0,255}$")
"""A SageMaker managed MLflow tracking server's (or MLflow app's) ARN, as SageMaker's API writes it."""


def tracking_uri(value: str) -> str:
    """An MLflow server's http(s) URL without credentials, or a SageMaker managed MLflow ARN."""
    if value.startswith("arn:"):
        if not MLFLOW_ARN.match(value):
            raise ValueError(f"{value!r} is not a SageMaker MLflow ARN (arn:aws:sagemaker:REGION:ACCOUNT:"
                             "mlflow-tracking-server/NAME, or mlflow-app/NAME)")
        return value
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises on a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{without_credentials(value)!r} is not an http:// or https:// URL of an MLflow server, "
                         "nor a SageMaker MLflow ARN; for a local one, `trnflow tracking server` prints its URL")
    if parts.username or parts.password:
        raise ValueError("holds credentials; a spec is no place for secrets: give them to the orchestrator's "
                         "environment as MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                         "MLFLOW_TRACKING_TOKEN), and write the URL without them")
    if parts.query or parts.fragment:  # not repeated: it may hold a token
        raise ValueError("has a query or fragment; write the server's base URL (a token goes in the orchestrator's "
                         "environment as MLFLOW_TRACKING_TOKEN)")
    if parts.scheme == "http" and not is_loopback(value):
        raise ValueError(f"{value!r} is plain http on another machine: its credentials and every run's metrics "
                         "would cross the network in the clear; use https (plain http only on loopback)")
    return value.rstrip("/")


class TrackingSpec(Section):
    """Where each run is mirrored for experiment tracking, besides trnflow's own records (which stay
    the source of truth): an MLflow server, and TensorBoard event files."""

    mlflow_uri: Annotated[str, AfterValidator(tracking_uri)] | None = Field(
        None, description="The MLflow tracking server each run is mirrored to: http(s)://HOST[:PORT][/PATH] (no "
        "credentials: MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the orchestrator's "
        "environment), or a SageMaker managed MLflow ARN (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/"
        "NAME or mlflow-app/NAME; needs the sagemaker-mlflow plugin: pip install 'trnflow[mlflow]'). None: no MLflow. "
        "Each pipeline run is mirrored there when it ends, by the orchestrator (jobs need no path to it); one it "
        "cannot reach is kept for `trnflow tracking sync` and never fails the run.")
    experiment: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_./-]{1,256}$",
        description="The MLflow experiment runs are recorded in (letters, digits, - _ . /); default: the spec's name.")
    tensorboard: bool = Field(
        False, description="Write each run's step metrics (training loss, learning rate, samples/s, the candidate's "
        "and the reference's holdout metrics, the gate's difference) as TensorBoard event files under "
        "`<train.checkpoint_url>/<run id>/tensorboard/` when the run ends: `tensorboard --logdir "
        "<train.checkpoint_url>` shows every run (an s3:// folder is read by TensorBoard with boto3).")


class PreflightSpec(Section):
    """Hardware sanity and collective tests that gate a run before any training starts."""

    exclude_bad_cores: bool = Field(
        False, description="Go on without cores that fail the sanity tests, if enough healthy ones remain: other "
        "cores are checked, then used (on SageMaker and Batch, other cores of the same instances; an instance "
        "without enough healthy ones is replaced, and the preflight runs again on the new one)."
    )
    min_busbw_gbps: float | None = Field(
        None, ge=0, le=1_000_000,
        description="Fail preflight when the all-reduce bus bandwidth (GB/s) falls below this."
    )
    max_latency_us: float | None = Field(
        None, gt=0, le=3.6e9, description="Fail preflight when the smallest all-reduce takes longer than this (us)."
    )
    collective_timeout_seconds: float = Field(
        120.0, gt=0, le=3600, description="A collective that does not complete in this time is reported as hung."
    )
    checkpoint_round_trip: bool = Field(
        True, description="Before training, write a checkpoint of the spec's model and optimizer shapes where the "
        "run's checkpoints go (`<checkpoint_url>/<run id>/_preflight/`), read it back, compare it and delete it: a "
        "location that cannot take a checkpoint fails the preflight, not the first save an interval into training."
    )


class FaultSpec(Section):
    """A fault to inject, to rehearse how the pipeline copes (the TRNFLOW_FAULTS variable adds more)."""

    kind: Literal["corrupt", "hang", "memory", "kill", "timeout", "hw", "nan", "stall", "torn"] = Field(
        description="corrupt: wrong results from the core's engines; hang: the core stalls in a collective; "
        "memory: the core's memory pattern test fails. Once per run at `step`: kill: the rank is killed with "
        "SIGKILL; timeout: an execution timeout; hw: an uncorrectable hardware error; nan: the step's result "
        "turns to NaN; stall: the rank stops making progress (a host that stopped answering); torn: the rank is "
        "killed halfway through writing its next checkpoint or inference shard."
    )
    core: int = Field(ge=0, le=1023, description="The NeuronCore id the fault hits.")
    step: int | None = Field(
        None, ge=1, le=MAX_STEPS,
        description="When a kill, timeout, hw, nan, stall or torn fault strikes (required for those): the training "
        "step, or in inference the rank's n-th shard."
    )
    phase: Literal["train", "infer"] | None = Field(
        None, description="Strike only in this phase (default: once in each, training and inference)."
    )

    @model_validator(mode="after")
    def _step_for_training_faults(self) -> FaultSpec:
        training = self.kind in ("kill", "timeout", "hw", "nan", "stall", "torn")
        if training and self.step is None:
            raise ValueError(f"faults: a {self.kind} fault needs `step`, the step it strikes at")
        if not training and (self.step is not None or self.phase is not None):
            raise ValueError(f"faults: a {self.kind} fault is a property of the core; remove `step` and `phase`")
        return self


class JobSpec(Section):
    """A trnflow job: one model, its data, where it runs, and its six pipeline stages."""

    name: str = Field(
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Job name: lower-case letters, digits and dashes (it becomes part of cloud job names).",
    )
    model: ModelSpec = Field(default_factory=ModelSpec, description="The model: its recipe and the recipe's settings.")
    data: DataSpec = Field(description="Input data.")
    compute: ComputeSpec = Field(default_factory=ComputeSpec, description="Backend and topology.")
    compile: CompileSpec = Field(default_factory=CompileSpec, description="Ahead-of-time compilation.")
    train: TrainSpec = Field(description="Training.")
    retries: RetrySpec = Field(default_factory=RetrySpec, description="Retry policy for transient failures.")
    gate: GateSpec = Field(default_factory=GateSpec, description="Accuracy-parity gate.")
    inference: InferenceSpec = Field(description="Offline batch inference.")
    schedule: ScheduleSpec | None = Field(None, description="Cron schedule for incremental retraining.")
    preflight: PreflightSpec = Field(default_factory=PreflightSpec, description="Preflight checks.")
    faults: list[FaultSpec] = Field(default_factory=list, description="Faults to inject, for rehearsals and tests.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec,
                                   description="Experiment tracking: the MLflow server runs are mirrored to.")
    registry_url: Url | None = Field(
        None,
        description="Model registry (a directory or s3:// URL): versions, and the champion that a passed gate "
        "promotes. Needed for `champion` in train.init_from and gate.reference.",
    )

    @model_validator(mode="after")
    def _shards_where_it_can(self) -> JobSpec:
        if self.train.parallelism.strategy == "fsdp" and self.compute.device == "xla":
            raise ValueError(XLA_FSDP)
        return self

    @model_validator(mode="after")
    def _tensor_groups_fit_a_node(self) -> JobSpec:
        tp, cores = self.train.parallelism.tp_degree, self.compute.cores_per_node
        if self.train.parallelism.tp != 1 and self.compute.device == "xla":
            raise ValueError(XLA_TP)
        if cores % tp:
            fits = [n for n in range(1, cores + 1) if cores % n == 0]
            raise ValueError(f"train.parallelism.tp: {tp} does not divide compute.cores_per_node ({cores}); tensor "
                             f"parallelism never crosses nodes, so use one of {fits}")
        floor = self.train.parallelism.min_cores_per_node
        if tp > 1 and floor is not None and floor % tp:
            raise ValueError(f"train.parallelism.min_cores_per_node: {floor} is not a multiple of train.parallelism.tp "
                             f"({tp}); fewer cores must still hold whole tensor-parallel groups")
        return self

    @model_validator(mode="after")
    def _fewer_cores_than_it_has(self) -> JobSpec:
        floor = self.train.parallelism.min_cores_per_node
        if floor is not None and floor > self.compute.cores_per_node:
            raise ValueError(f"train.parallelism.min_cores_per_node: {floor} is more than compute.cores_per_node "
                             f"({self.compute.cores_per_node}); set it at most that, or leave it out")
        return self

    @model_validator(mode="after")
    def _batch_divides(self) -> JobSpec:
        world = self.compute.world_size
        gbs = self.train.global_batch_size
        if gbs % world:
            fixed = max(world, round(gbs / world) * world)
            raise ValueError(
                f"train.global_batch_size: {gbs} is not divisible by the {world} NeuronCores "
                f"(compute.nodes x compute.cores_per_node); use {fixed}"
            )
        return self

    @model_validator(mode="after")
    def _faults_on_real_cores(self) -> JobSpec:
        itype = instance(self.compute.instance_type)
        for i, fault in enumerate(self.faults):
            if fault.core >= itype.cores:
                raise ValueError(f"faults.{i}.core: {itype.name} has {itype.cores} NeuronCores (0-{itype.cores - 1}); "
                                 f"pick a core below {itype.cores}")
        return self

    @model_validator(mode="after")
    def _stalls_outlast_collectives(self) -> JobSpec:
        """A rank waiting in a collective makes no progress: were it ended as stalled first, the
        collective's timeout could never name the rank that did not come."""
        hang, collective = self.compute.hang_timeout_minutes * 60, self.preflight.collective_timeout_seconds
        if hang <= collective:
            raise ValueError(f"compute.hang_timeout_minutes: {hang:g} s is not longer than "
                             f"preflight.collective_timeout_seconds ({collective:g} s); ranks waiting in a collective "
                             "would be ended as stalled before the collective's timeout names the one that never "
                             f"came. Set it above {collective / 60:g} min, or shorten the collective timeout")
        return self

    @model_validator(mode="after")
    def _champion_needs_a_registry(self) -> JobSpec:
        uses = [f for f, v in (("train.init_from", self.train.init_from), ("gate.reference", self.gate.reference))
                if v == "champion"]
        if uses and self.registry_url is None:
            raise ValueError(f"{uses[0]}: `champion` needs registry_url, the registry the champion is kept in")
        return self

    @model_validator(mode="after")
    def _cloud_locations_on_s3(self) -> JobSpec:
        problems = cloud_location_problems(self.compute.backend, self.job_locations())
        if problems:
            raise ValueError("\n".join(problems))  # one line per field; the loader lists each
        return self

    def job_locations(self) -> dict[str, str | None]:
        """The locations the stage jobs themselves read or write, by field. The gate's reference and
        the registry are read by the flow's own process (the registry by the training job too, when
        it starts from the champion), so they may be local to wherever the flow runs."""
        found = {"data.train": self.data.train, "data.holdout": self.data.holdout,
                 "data.inference": self.data.inference, "train.checkpoint_url": self.train.checkpoint_url,
                 "train.init_from": self.train.init_from, "compile.cache_url": self.compile.cache_url,
                 "inference.output_url": self.inference.output_url}
        if self.train.init_from == "champion":
            found["registry_url"] = self.registry_url
        return found

    @property
    def data_parallel_size(self) -> int:
        """How many replicas the batch is split over: every core, or each tensor-parallel group of cores."""
        return self.compute.world_size // self.train.parallelism.tp_degree

    @property
    def per_core_batch(self) -> int:
        """Samples each core computes a step: its replica's share of the global batch (the cores of a
        tensor-parallel group compute the same samples together)."""
        return self.train.global_batch_size // self.data_parallel_size

    def evaluates_at(self, step: int) -> bool:
        """Whether training evaluates the holdout after `step`: every gate.eval_every steps, and at the last."""
        every, last = self.gate.eval_every, self.train.steps
        return 1 <= step <= last and (step == last or bool(every and step % every == 0))

    def evaluation_steps_text(self) -> str:
        """The steps training evaluates at, as a short list: `[100, 200, 300]`, `[50, 100, ..., 1000]`."""
        every, last = self.gate.eval_every, self.train.steps
        steps = list(range(every, last, every)) if every and every < last and last // every <= 6 else None
        if steps is not None:
            return str([*steps, last])
        if every and every < last:
            tail = "" if last % every == 0 else f", {last}"
            return f"[{every}, {2 * every}, ..., {last // every * every}{tail}]"
        return f"[{last}]"

    def on_instance(self, instance_type: str) -> JobSpec:
        """This spec as run on `instance_type`, one of its compute.instance_choices (each was checked
        against the job when the spec was validated): that type first, the ones after it still listed."""
        choices = self.compute.instance_choices
        if instance_type == self.compute.instance_type:
            return self
        if instance_type not in choices:
            raise ValueError(f"{instance_type} is not one of compute.instance_preferences")
        rest = choices[choices.index(instance_type):]
        compute = self.compute.model_copy(update={"instance_type": instance_type, "instance_preferences": rest})
        return self.model_copy(update={"compute": compute})

    def on_fewer_cores(self, healthy: int) -> JobSpec | None:
        """This spec on the `healthy` cores an instance has left, when that is fewer than
        compute.cores_per_node and train.parallelism.min_cores_per_node allows it: the most cores, no
        fewer than that floor, whose world size divides train.global_batch_size. None otherwise. (Whether
        the model fits that many is checked when the job is submitted, as for any spec.)"""
        floor, cores = self.train.parallelism.min_cores_per_node, self.compute.cores_per_node
        if floor is None or healthy >= cores:
            return None
        tp = self.train.parallelism.tp_degree
        for count in range(healthy, floor - 1, -1):
            if self.train.global_batch_size % (count * self.compute.nodes) == 0 and count % tp == 0:
                data = self.model_dump()
                data["compute"]["cores_per_node"] = count
                return type(self).model_validate(data)  # checked whole, as any spec is
        return None

    def digest(self) -> str:
        """A stable hash of the whole spec (field order and formatting do not matter)."""
        blob = json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]
