"""The job spec: what to train, on what, and how to judge and use the result.

Every section forbids unknown keys and describes every field, so `trnflow schema` gives editors
completion and a typo is an error rather than a silently ignored setting. The sections live in
their own modules (fields, compute, training, judging, operations); this one holds the model and
data sections and the spec that joins them, and names every section for its importers.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, model_validator

from trnflow.specs.compute import (
    BATCH_SPOT_TYPES,
    HOST_RESERVED_MEMORY_GIB,
    ComputeSpec,
    cloud_location_problems,
    container_memory_limit_gib,
    memory_problem,
    sagemaker_checkpoint_problem,
)
from trnflow.specs.fields import (
    MAX_STEPS,
    METRIC_NAME,
    MODULE_REFERENCE,
    RECIPE_NAME,
    ChampionOrUrl,
    Section,
    Url,
    is_module_reference,
    recipe_reference,
)
from trnflow.specs.instances import instance
from trnflow.specs.judging import ABS_DIFF, GateSpec, GenerateSpec, InferenceSpec
from trnflow.specs.operations import FaultSpec, PreflightSpec, ScheduleSpec, TrackingSpec, tracking_uri
from trnflow.specs.training import (
    XLA_FSDP,
    XLA_TP,
    CompileSpec,
    Layout,
    ParallelismSpec,
    RetrySpec,
    TrainSpec,
    default_cache_url,
)

__all__ = [
    "ABS_DIFF", "BATCH_SPOT_TYPES", "HOST_RESERVED_MEMORY_GIB", "MAX_STEPS", "METRIC_NAME", "MODULE_REFERENCE",
    "RECIPE_NAME", "XLA_FSDP", "XLA_TP", "ChampionOrUrl", "CompileSpec", "ComputeSpec", "DataSpec", "FaultSpec",
    "GateSpec", "GenerateSpec", "InferenceSpec", "JobSpec", "Layout", "ModelSpec", "ParallelismSpec", "PreflightSpec",
    "RetrySpec", "ScheduleSpec", "Section", "TrackingSpec", "TrainSpec", "Url", "cloud_location_problems",
    "container_memory_limit_gib", "default_cache_url", "is_module_reference", "memory_problem",
    "sagemaker_checkpoint_problem", "tracking_uri",
]


class ModelSpec(Section):
    """Which model the pipeline trains: a recipe and its settings."""

    recipe: Annotated[str, AfterValidator(recipe_reference)] = Field(
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
    packing: bool = Field(
        False,
        description="Pack the training rows several to a seq_len window, in the order they are read, each "
        "attending only to itself, its positions restarting at 0; the loss counts the same tokens as unpacked. "
        "For recipes whose rows are tokens (hf-causal-lm); the holdout and inference rows stay one per row.",
    )


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
        tp, cores = self.train.parallelism.tp, self.compute.cores_per_node
        if tp != 1 and self.compute.device == "xla":
            raise ValueError(XLA_TP)
        if tp == "auto":  # the planner takes only a tp that divides the node's cores
            return self
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
    def _recomputes_what_it_can(self) -> JobSpec:
        tp = self.train.parallelism.tp
        if self.train.activation_checkpointing == "full" and isinstance(tp, int) and tp > 1:
            raise ValueError(f"train.activation_checkpointing: full with train.parallelism.tp {tp} cannot run yet (the "
                             "compiled step of split layers that recompute whole fails in PyTorch's AOT autograd); "
                             "use selective, or auto, which picks it, or tp 1")
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
    def layout(self) -> Layout:
        """How the run spreads the model (train.parallelism), decided: a ValueError while either of
        its settings is still `auto`, which the run decides when it starts."""
        found = self.train.parallelism.layout
        recompute = self.train.activation_checkpointing
        if found is None or recompute == "auto":
            raise ValueError("train.parallelism, train.activation_checkpointing: `auto` is decided when the run "
                             "starts (trnflow.workload.memory.decided), and this spec is still undecided; decide it "
                             "before reading the layout")
        return found.model_copy(update={"recompute": recompute})

    @property
    def decided(self) -> bool:
        """Whether nothing of its layout is left `auto` (train.parallelism, train.activation_checkpointing)."""
        return self.train.parallelism.layout is not None and self.train.activation_checkpointing != "auto"

    @property
    def tp(self) -> int:
        """The cores each layer is split over (train.parallelism.tp), decided: a ValueError while it is
        still `auto`. (With the strategy still `auto`, it is known all the same.)"""
        tp = self.train.parallelism.tp
        if tp == "auto":
            raise ValueError("train.parallelism.tp: `auto` is decided when the run starts (trnflow.workload.memory."
                             "decided), and this spec is still undecided; decide it before reading tp")
        return tp

    def with_layout(self, chosen: Layout) -> JobSpec:
        """This spec with train.parallelism's strategy and tp, and train.activation_checkpointing, set
        to `chosen` (itself when already so)."""
        if self.decided and self.layout == chosen:
            return self
        parallelism = self.train.parallelism.model_copy(update={"strategy": chosen.strategy, "tp": chosen.tp})
        train = self.train.model_copy(update={"parallelism": parallelism, "activation_checkpointing": chosen.recompute})
        return self.model_copy(update={"train": train})

    @property
    def data_parallel_size(self) -> int:
        """How many replicas the batch is split over: every core, or each tensor-parallel group of cores."""
        return self.compute.world_size // self.tp

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
        tp = self.tp
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
