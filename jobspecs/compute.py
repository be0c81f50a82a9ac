"""The spec's compute section: where a job runs (backend, instance type and its alternatives,
cores, device, precision, spot, limits), with what each service allows of it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from trnflow.specs.fields import Section
from trnflow.specs.instances import BILLED_BY, CATALOGUE, TRAINING_TYPES, instance, price

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

BATCH_SPOT_TYPES = ("trn1.32xlarge",)
"""The instance types of the infra stack's Batch spot compute environment: one, because Batch places
a single-node job by its vCPUs and memory, so a smaller spec could land on a larger type."""

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
    hang_step_factor: float | None = Field(
        3.0, ge=1.5, le=1000,
        description="Once training has measured a few steps of an attempt, a rank that makes no progress for this "
        "many times its median step (of the last 50) plus compute.hang_floor_seconds is ended as stalled, long "
        "before compute.hang_timeout_minutes; a rank waiting in a step's collective names the ranks that never "
        "began that step (and their hosts). Evaluations and checkpoints are not held to it. null: only "
        "compute.hang_timeout_minutes.",
    )
    hang_floor_seconds: float = Field(
        60.0, gt=0, le=24 * 3600,
        description="What the stall limit of a training step adds to compute.hang_step_factor times the median "
        "step: room for a step's usual jitter (a logged step's bookkeeping, a slower batch, a busy host).",
    )
    slow_rank_factor: float | None = Field(
        1.5, ge=1.05, le=100,
        description="At each logged training step, a rank whose own work per step (forward and backward, before "
        "gradients are averaged) over the steps since the last comparison (5 at least) took more than this many "
        "times its peers' median is named as slow, with its host, in the log, the stage's summary and `trnflow "
        "status`; should the attempt fail, its host is replaced before the next (AWS Batch). Under fsdp "
        "and tp a rank's passes wait on its peers too, which hides some of it; on xla and neuron, lazy devices, "
        "the time is the host's tracing. null: not compared.",
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
