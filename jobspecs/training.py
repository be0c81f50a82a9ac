"""The spec's compile, train (with its parallelism) and retries sections."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, model_validator

from trnflow.specs.fields import MAX_STEPS, ChampionOrUrl, Section, Url
from trnflow.urls import normalise_url

XLA_TP = ("train.parallelism.tp does not run on the xla device (trn1, through torch-xla), which trnflow does not "
          "split; use tp: 1 there, or compute.device: neuron (trn2, trn3) or emulator")
XLA_FSDP = ("train.parallelism.strategy: fsdp does not run on the xla device (trn1, through torch-xla), which "
            "shards with its own SPMD-based FSDP that trnflow does not drive; use ddp (or auto, which refuses what "
            "ddp cannot fit) on trn1, or the neuron device on trn2 and trn3")
"""Why sharded training is refused on torch-xla."""


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

    def unlimited(self) -> CompileSpec:
        """These settings with no recompilation limit: for a run that compiles its own graphs as it
        meets them (the fp32 reference, a calibration), whatever limit the spec's runs keep to."""
        return self.model_copy(update={"fail_on_recompile": False, "max_recompiles": None})

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


class Layout(Section):
    """How a run spreads the model over its cores, decided: the strategy and the tensor-parallel
    degree. A spec's `auto` becomes one when the run starts (`trnflow.workload.memory.layout`), and
    the run keeps it whatever instance type its jobs get."""

    strategy: Literal["ddp", "fsdp"] = Field(description="ddp (whole model on every core) or fsdp (sharded).")
    tp: int = Field(ge=1, le=64, description="The cores each layer is split over (1: none).")
    recompute: Literal["none", "selective", "full"] = Field(
        "none", description="What the blocks recompute in backward (train.activation_checkpointing).")

    def describe(self) -> str:
        shape = f"{self.strategy}, tp {self.tp}" if self.tp > 1 else self.strategy
        return shape if self.recompute == "none" else f"{shape}, {self.recompute} recomputation"


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

    min_cores_per_node: int | None = Field(
        None, ge=1, le=64,
        description="On the local backend, after a hardware error leaves the instance fewer healthy cores than "
        "compute.cores_per_node, later attempts train on as many as are left, down to this many (the most that "
        "divide train.global_batch_size), resuming from the last checkpoint resharded over them. Null: an attempt "
        "always needs compute.cores_per_node healthy cores. (A cloud retry gets new instances with every core.)",
    )

    @property
    def layout(self) -> Layout | None:
        """The layout these settings name, or None while either is `auto` (undecided)."""
        if self.strategy == "auto" or self.tp == "auto":
            return None
        return Layout(strategy=self.strategy, tp=self.tp)


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
    checkpoint_async: bool = Field(
        True,
        description="Write checkpoints in the background: at the step boundary the state is copied to host memory "
        "and training goes on while it is written (checkpoint_writer), committed (its marker last) only once every "
        "file is whole; the next checkpoint waits for it. The run's last checkpoint is written while the holdout "
        "evaluates its weights, its meta and marker after; it, and one a stop asks for, are committed before the job "
        "ends. Sharded layouts (fsdp, tp) write every rank's shard so, over a process group of "
        "their own. false writes each before training goes on.",
    )
    checkpoint_writer: Literal["auto", "process", "thread"] = Field(
        "auto",
        description="Where rank 0 serializes and writes a whole checkpoint in the background (checkpoint_async): "
        "`process`, a writer process of its own that maps the copied state, so the training steps, which dispatch "
        "from Python, never wait on it for the interpreter's lock; `thread`, a thread of the training process "
        "(no process to start, about a second of a CPU); `auto`, the process once the copied state is at least "
        "64 MiB. The process paces its writes over half the steps to the next checkpoint, unless the loop waits for "
        "it. Sharded layouts write their shards on a thread of every rank.",
    )
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
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = Field(
        "none",
        description="Trade device memory for time: the recipe's blocks (the transformer layers) recompute in the "
        "backward pass what their forward pass computed instead of keeping it. full: a block keeps only its "
        "inputs (least memory; about one more forward pass of time). selective: a block keeps the outputs of its "
        "matrix products and attention (the recipe's saved_ops) and recomputes the rest (normalizations, "
        "activations, dropout), most of the saving for little time. Dropout replays the same random stream, so "
        "losses and weights equal those without it. none: everything is kept. auto: the memory planner's choice, "
        "the least recomputation with which the model fits a core, tried before fsdp and before a larger "
        "train.parallelism.tp (decided once, when the run starts).",
    )
    on_divergence: Literal["stop", "rollback"] = Field(
        "stop",
        description="What a divergence does: a step whose loss is not finite, or (with rollback) is over "
        "train.spike_factor times the median of its last 20 (on any rank). stop: the run stops and is never "
        "retried. rollback: training goes back to its newest checkpoint before that step, replays the steps "
        "between, skips the diverged step's batch (recorded, with why, in the run's rollbacks.json and its "
        "result) and goes on; after train.max_rollbacks the next divergence stops the run.",
    )
    spike_factor: float = Field(
        5.0, gt=1, le=1e6, description="With on_divergence: rollback, a loss over this many times the median of "
        "the rank's last 20 losses (once it has 5) is a spike.",
    )
    max_rollbacks: int = Field(3, ge=0, le=1000, description="Rollbacks a run may make (on_divergence: rollback).")
    skip_steps: list[Annotated[int, Field(ge=1, le=MAX_STEPS)]] = Field(
        default_factory=list, max_length=10_000,
        description="Training steps whose batches are not trained on (their optimizer step is skipped), as a "
        "rollback skips a diverged step: a run told so from the start ends with the same weights.",
    )


class RetrySpec(Section):
    """How transient failures (lost cores, timeouts, capacity) are retried. Bad specs never are."""

    max_retries: int = Field(2, ge=0, le=10, description="Retries of a stage after a transient failure.")
    backoff_seconds: float = Field(10.0, ge=0, le=3600, description="First retry delay; doubles each retry.")
    jitter: float = Field(0.5, ge=0, le=1, description="Random fraction added to each delay.")
