"""The results that cross rooms, as types: what each workload phase reports (rank 0's `result.json`),
what each stage task returns, and what a flow run ends with.

The workload writes a phase's result as JSON; `parse` reads it back into the phase's model at the one
place a job's result enters the orchestrating side (`trnflow.tasks._jobs.run_job`). A field the model
does not know is an error there, so producer and consumers cannot drift apart unnoticed. What a
job measured on its hardware (checks, sweeps, memory, compile plans) is `trnflow.measures`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, SerializeAsAny

from trnflow.errors import ChampionKept
from trnflow.measures import (
    CoreChecks,
    DeviceMemory,
    GraphSeen,
    HostInventory,
    HostMemory,
    MemoryFigures,
    ParallelCompile,
    PlanSummary,
    ProgramOutcome,
    ProgramPlan,
    SweepRow,
)
from trnflow.records import CurvePoint, MetricPoint, RecipeRef, Rollback, TrainTime, Verdict


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CompileMetrics(_Model):
    """What a job's compile backend did: graphs compiled, cache hits, recompilations after warm-up."""

    graphs: int = Field(0, description="graphs compiled by this job")
    hits: int = Field(0, description="graphs loaded from the compile cache")
    recompiles: list[GraphSeen] = Field(default_factory=list,
                                        description="each recompilation: program, key, shapes and reason")
    seconds: float = Field(0.0, description="time spent compiling")


class DeviceUsed(_Model):
    """The device a job ran on, and why (`compute.device`, resolved where the job ran)."""

    name: str = Field(description="emulator, neuron or xla")
    reason: str = Field(description="what chose it")


class RanOn(_Model):
    """Where a stage's job ran, as the service that ran it says."""

    backend: str = Field(description="local, sagemaker or batch")
    job_id: str = Field(description="the job: a local job's folder, a SageMaker training job, a Batch job id")
    instance_type: str = Field(description="the instance type the job got (one of compute.instance_preferences, "
                               "when the spec lists them)")
    hosts: list[str] = Field(default_factory=list, description="the instances it held, where the service names "
                             "them")


class NodeIdentity(_Model):
    """One node of a cloud job as its container finds itself at the start of each attempt, uploaded
    as `hosts/attempt<a>/node<r>.json` beside the job's results (`trnflow.backends.container`)."""

    node: int = Field(description="the node's index in the job (Batch's node index; SageMaker's host order)")
    attempt: int = Field(1, ge=1, description="the job's attempt (Batch's AWS_BATCH_JOB_ATTEMPT; 1 on SageMaker, "
                         "whose restarts replace it)")
    host: str = Field(description="SageMaker's host name (algo-1), else the container's host name")
    instance_id: str | None = Field(None, description="the EC2 instance id from the instance metadata service, "
                                    "where the container can reach it (Batch; SageMaker hides it)")
    instance_type: str | None = Field(None, description="the EC2 instance type, likewise")
    started_at: float = Field(description="when the container started (Unix seconds)")

    @property
    def label(self) -> str:
        """The instance id where there is one, else the host name."""
        return self.instance_id or self.host


class Placement(_Model):
    """The cores each node's ranks run on once the preflight of a job that runs several phases
    excluded bad ones (`phases/placement-<attempt>-<round>.json`, written by its main node): every
    node checks them, then trains on them."""

    round: int = Field(ge=1, description="1 for the first exclusion, 2 when the cores it chose failed too, ...")
    cores: dict[int, str] = Field(description="each node's NEURON_RT_VISIBLE_CORES (a core, or a range)")
    excluded: dict[int, list[int]] = Field(description="each node's cores left out, as they failed their checks")


class Proceed(_Model):
    """The orchestrator's word to the nodes of a job that runs several phases in one allocation,
    waiting between them (`proceed-<phase>.json` beside the job's results): the phase may start,
    or the job is to end."""

    phase: str = Field(description="the phase this is about")
    go: bool = Field(description="True: start it; False: end the job")
    reason: str = Field("", description="why not, when not")
    budget_usd: float | None = Field(None, ge=0, description="training: what it may cost, in US dollars at on-demand "
                                     "prices, as the orchestrator reckons it now (None: no limit)")


class StageResult(_Model):
    """What every stage's result carries."""

    phase: str | None = Field(None, description="the workload phase that produced it, when a job ran")
    device: DeviceUsed | None = Field(None, description="the device the job ran on, and why")
    cores: list[int] | None = Field(None, description="the NeuronCores the job ran on (None: the service placed it)")
    summary: str = Field("", description="the stage's key figure, one line")
    compile: CompileMetrics | None = Field(None, description="what the job compiled")
    ran_on: RanOn | None = Field(None, description="where the job ran; None for a stage that ran no job")


class CollectivesResult(StageResult):
    ranks: int = Field(description="cores in the sweep")
    rows: list[SweepRow] = Field(description="nccom-test's rows: op, size(B), time:avg(us), algbw, busbw, correct")
    avg_busbw: float | None = Field(description="mean bus bandwidth (GB/s); None when one core had no peer")
    avg_busbw_by_op: dict[str, float] = Field(default_factory=dict, description="mean bus bandwidth per op")
    passed: bool = Field(True, description="every result was correct")
    bad_cores: list[int] = Field(default_factory=list, description="cores that sent corrupted data")
    note: str | None = Field(None, description="why the sweep did not run, or what it found wrong")
    source: str = Field("trnflow", description="what swept: nccom-test on a Neuron host, else trnflow's own test")
    plans: list[PlanSummary] = Field(
        default_factory=list, description="each swept op's ring and tree plan over the job's cores at the largest "
        "size: steps, steps crossing nodes, bytes sent per rank, bus factor")


class CheckpointRoundTrip(_Model):
    """The preflight's checkpoint round trip (`trnflow.workload.roundtrip`): a checkpoint of the spec's
    model written where the run's go, read back, compared and deleted."""

    url: str = Field(description="where it was written (`<checkpoint_url>/<run id>/_preflight`)")
    bytes: int = Field(description="the weights' and optimizer state's bytes (a sharded one's: its files')")
    write_seconds: float = Field(description="writing it, marker last")
    read_seconds: float = Field(description="reading it back (a sharded one's: into a fresh spread model)")
    layout: str = Field(description="whole (rank 0 wrote it alone) or sharded (every rank wrote its shard)")
    ranks: int = Field(description="the ranks that wrote it")
    passed: bool = Field(description="read back as written")
    left: str | None = Field(None, description="what could not be deleted afterwards, if anything")


class SanityResult(StageResult):
    per_core: list[CoreChecks] = Field(description="each core's known-answer checks and which failed")
    bad_cores: list[int] = Field(default_factory=list, description="cores that failed a check")
    passed: bool = Field(description="every core passed")
    excluded_cores: list[int] = Field(default_factory=list, description="bad cores left out of the run")
    memory: MemoryFigures | None = Field(None, description="what each core must hold to train the spec")
    inventory: HostInventory | None = Field(None, description="the host's device list against the job's cores")
    collectives: CollectivesResult | None = Field(
        None, description="the collective sweep the same job ran between its cores once every core passed (a "
        "pipeline's preflight, which then needs no collectives job); None when a core failed or no spec was given")
    checkpoint: CheckpointRoundTrip | None = Field(
        None, description="the checkpoint round trip (preflight.checkpoint_round_trip); None when off")


class CompileResult(StageResult):
    programs: list[ProgramPlan] = Field(description="each program's key, input shapes and cache state")
    graphs: int = Field(description="programs in the plan")
    flags: dict[str, JsonValue] | None = Field(None, description="the compiler flags the keys were made with (each "
                                               "device's compiler has its own)")
    compiler: str = Field(description="the compiler version in the cache layout")
    cache: str = Field(description="the compile cache URL")
    check: bool = Field(False, description="a warm check only: nothing was compiled")
    hits: int = Field(0, description="programs the cache held")
    misses: int = Field(0, description="programs a warm check found missing")
    compiled: int = Field(0, description="programs compiled by this job")
    report: dict[str, ProgramOutcome] = Field(
        default_factory=dict, description="per key: status, seconds, retries and, for a compiled one, how many "
        "graphs one run of its program compiled (together)")
    seconds: float = Field(0.0, description="compile time of every program together")
    launched: bool = Field(True, description="a compile job ran (False: every program was known to hit)")
    parallel_compile: ParallelCompile | None = Field(
        None, description="what the SDK's neuron_parallel_compile reported, where it ran the trial first")


class TrialResult(StageResult):
    """The compile phase's trial alone (`--options '{"trial": true}'`), which the SDK's
    neuron_parallel_compile wraps: every program run on inputs of its shapes, its graphs compiled
    into the cache by the tool."""

    trial: bool = Field(True, description="always true: the trial ran, and nothing was recorded")
    programs: list[str] = Field(description="the programs the trial ran")
    steps: int = Field(ge=1, description="steps of each")


HOST_MEMORY = "what the ranks held in host memory"


class SlowRank(_Model):
    """A rank whose own work in the training steps of a logged window (forward and backward) took
    longer than its peers' median by more than compute.slow_rank_factor: a suspect host."""

    rank: int
    core: int
    host: str = Field(description="its host as the service names it (algo-2, Batch node 1), with the host name")
    step: int = Field(description="the logged step that ended the window")
    own_seconds: float = Field(description="its median own work per step over the window")
    peers_seconds: float = Field(description="the median of its peers' own medians over the same window")
    ratio: float = Field(description="own_seconds over peers_seconds")

    def __str__(self) -> str:
        return f"rank {self.rank} (nc{self.core} on {self.host}): {self.ratio:.1f}x its peers' median step"


class SlowRanks(_Model):
    """The ranks a training attempt has named slow so far, each at its slowest window: rank 0's
    `slow-ranks.json` beside its result, written at each logged step that named one, so that its
    job's container can report their hosts as suspects should the attempt fail."""

    FILE: ClassVar[str] = "slow-ranks.json"
    slow: list[SlowRank] = Field(description="by rank")


class PackingFill(_Model):
    """How full the packed windows are."""

    rows: int = Field(description="rows packed")
    windows: int = Field(description="windows they went into")
    tokens: int = Field(description="their real tokens")
    seq_len: int = Field(description="each window's length")

    @property
    def fill(self) -> float:
        """The share of the windows' tokens that are real."""
        return self.tokens / (self.windows * self.seq_len) if self.windows else 0.0

    @property
    def unpacked(self) -> float:
        """The share that would be real with one row a window."""
        return self.tokens / (self.rows * self.seq_len) if self.rows else 0.0

    def __str__(self) -> str:
        return (f"{self.rows} rows packed into {self.windows} windows of {self.seq_len} tokens, "
                f"{self.fill:.1%} of them real")


class TrainResult(StageResult):
    skipped: bool = Field(False, description="no new data after the watermark: nothing trained")
    reason: str | None = Field(None, description="why training was skipped")
    run_id: str | None = None
    checkpoint: str | None = Field(description="the final checkpoint's URL")
    start_step: int = 0
    steps: int = 0
    steps_trained: int = 0
    resumed_from: str | None = Field(None, description="the checkpoint a retry resumed from")
    resumed_weights: str | None = Field(None, description="the weights it resumed with, as placed on the device "
                                        "(the sha256 of their tensors)")
    parent: str | None = Field(None, description="the model this one was trained further from")
    recipe: RecipeRef | None = Field(None, description="the model's recipe: name, version and params")
    global_step: int = 0
    watermark: str | None = Field(None, description="the newest day partition trained on")
    partitions: list[str] = Field(default_factory=list, description="the day partitions trained on")
    rows: int = Field(0, description="the training rows read")
    packing: PackingFill | None = Field(None, description="the rows packed into windows (data.packing), which the "
                                        "steps sampled: how full they were")
    loss: float | None = Field(None, description="the last step's training loss, on rank 0's share of its batch "
                               "(the stage's key figure is the curve's last point, a mean)")
    evaluations: list[MetricPoint] = Field(default_factory=list, description="holdout points during training")
    curve: list[CurvePoint] = Field(default_factory=list, description="logged loss against step")
    series: str | None = Field(None, description="the metric series the gate reads")
    holdout_sha256: str | None = None
    samples_per_s: float = 0.0
    seconds: float = 0.0
    first_step_seconds: float = 0.0
    median_step_seconds: float = 0.0
    device_memory: DeviceMemory | None = Field(None, description="what the ranks held on their devices")
    host_memory: HostMemory | None = Field(None, description=HOST_MEMORY)
    slow_ranks: list[SlowRank] = Field(default_factory=list, description="the ranks named slow, each at its "
                                       "slowest window (compute.slow_rank_factor)")
    rollbacks: list[Rollback] = Field(default_factory=list, description="the divergences the run healed, this "
                                      "attempt's and its earlier attempts' (train.on_divergence: rollback)")
    time: TrainTime = Field(default_factory=TrainTime, description="where the training time that led to the final "
                            "weights went, over the attempts that led to them")
    attempt_seconds: float = Field(0.0, description="this attempt's training, from reading its data to its result")
    time_before: TrainTime = Field(default_factory=TrainTime, description="of `time`, what the attempts before this "
                                   "one held: the checkpoint it resumed from")
    task_seconds: float = Field(0.0, description="this attempt's train task, from its start (the job's launch and "
                                "provisioning included) to its result")
    final_eval_seconds: float = Field(0.0, description="the holdout's evaluation of the final weights, after the "
                                      "last step: the gate's measurement of them, not part of getting them (goodput "
                                      "leaves it out)")


class Registration(_Model):
    """Where a candidate stands in the registry after the gate (`trnflow.lifecycle.judge.register`)."""

    version: int = Field(description="its version of the model")
    promoted: bool = Field(description="made the champion by this decision")
    generation: int = Field(description="the registry generation the decision was made against")
    checkpoint: str = Field("", description="the registered version's checkpoint: a rerun on the same inputs gets "
                            "the first run's, which later stages must use (one model and one output folder a version)")
    registered_before: bool = Field(False, description="a rerun (of the same run, or of the same spec on the same "
                                    "data): registered already")
    forced: bool = Field(False, description="promotable only because --force-promote said why: it is worse than "
                         "the champion")


class ChampionStays(_Model):
    """The candidate passed the gate but is worse than the champion, and nothing asked to promote it
    anyway (`trnflow.lifecycle.judge.settle`): registered, not promoted. The evaluate stage passed;
    the run ends in `ChampionKept` after it, before inference."""

    message: str = Field(description="what was decided, and how to promote it anyway")
    headline: str = Field(description="the reason in one short line, for the run's state message")

    def error(self) -> ChampionKept:
        """The run's ending, as the error its state carries."""
        return ChampionKept(self.message, headline=self.headline)


class ReferenceResult(StageResult):
    """The fp32 reference the gate judges against (`gate.reference: auto`): on record already, or
    trained by this stage."""

    url: str = Field(description="the reference's metrics file")
    trained: bool = Field(description="trained by this run (False: on record, from an earlier run)")
    checkpoint: str | None = Field(None, description="the reference training's final checkpoint")
    final: MetricPoint | None = Field(None, description="the reference's last evaluation")


class EvaluateResult(StageResult):
    checkpoint: str = Field(description="the checkpoint judged")
    points: list[MetricPoint] = Field(description="the candidate's metric points")
    series: str | None = None
    holdout_sha256: str | None = None
    correct: str | None = Field(None, description="per holdout row, '1' when the last point's prediction was right")
    directions: dict[str, str] = Field(default_factory=dict, description="which way each metric is better: "
                                       "higher or lower")
    verdict: Verdict | None = Field(None, description="the gate's verdict (`trnflow.lifecycle.gate`)")
    against: str | None = Field(None, description="what the candidate was judged against")
    chart: str | None = Field(None, description="the parity chart's URL")
    registry: Registration | None = Field(None, description="where it stands in the registry")
    kept: ChampionStays | None = Field(None, description="the champion stays: the candidate passed the gate but is "
                                       "worse than it")


class ShardWritten(_Model):
    """One Parquet shard of an inference output, as the manifest lists it."""

    shard: int = Field(ge=0, description="its index")
    file: str = Field(description="its file, in the output folder")
    rows: int = Field(ge=0, description="the rows it holds")
    sha256: str = Field(description="the sha256 of its bytes")
    reused: bool = Field(False, description="committed before under the same plan: not written again")


class InferResult(StageResult):
    output_url: str
    model_version: str | None = None
    published: str = Field("embeddings", description="what each row gets: embeddings, or predictions (the predicted "
                           "class and class probabilities) for a recipe without embeddings")
    rows: int = Field(description="rows embedded in all shards")
    shards: list[ShardWritten] = Field(description="each shard: index, file, rows, sha256, reused")
    rows_embedded: int = Field(0, description="rows embedded by this job (the rest were committed before)")
    shards_reused: int = 0
    manifest: str | None = None
    rows_per_s: float = 0.0
    program_load_seconds: float = 0.0
    host_memory: HostMemory | None = Field(None, description=HOST_MEMORY)


class PromoteResult(StageResult):
    version: int | None = None
    generation: int | None = None
    watermark: str | None = None
    published: str | None = Field(None, description="the manifest of the embeddings published")


RESULTS: dict[str, type[StageResult]] = {
    "sanity": SanityResult, "collectives": CollectivesResult, "compile": CompileResult, "train": TrainResult,
    "evaluate": EvaluateResult, "infer": InferResult, "promote": PromoteResult,
}


def parse(phase: str, data: dict[str, Any]) -> StageResult:
    """A phase's `result.json` as its model."""
    return RESULTS[phase].model_validate(data)


class FailureReport(_Model):
    """Why a job failed: a rank's own report (`failure-rank<r>.json`, written by the workload as it
    fails), the root failure a backend names among its ranks' reports, or the service's reason."""

    type: str = Field(description="the error's class (FatalError, HardwareError, KeyError, ...), or what the "
                      "launcher or service saw (WorkerLost, CollectiveTimeout, CapacityError, ...)")
    message: str = ""
    retryable: bool | None = Field(None, description="whether a retry can help; None when nobody knows (a bug, a "
                                   "peer's broken link)")
    bad_cores: list[int] = Field(default_factory=list, description="the NeuronCores found at fault")
    rank: int | None = Field(None, description="the rank that wrote it")
    ranks: list[int] = Field(default_factory=list, description="the ranks it is about, when no one rank wrote it")
    instances: list[str] = Field(default_factory=list, description="the instances found at fault (EC2 instance ids, "
                                 "else host names), which a BadHost failure has replaced")
    nodes: list[int] = Field(default_factory=list, description="the job's nodes found at fault (their indices): the "
                             "orchestrator asks the service which instance each ran on")
    traceback: str | None = None
    reported_at: float | None = Field(None, description="when the rank wrote it (Unix seconds)")
    exitcode: int | None = Field(None, description="how the rank's process ended, as torchrun saw it")
    signal: str | None = Field(None, description="the signal that ended it (SIGKILL), if one did")

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


class StageRow(_Model):
    """One row of a run's stage table."""

    stage: str
    state: str = Field(description="Completed, Skipped, Failed, Crashed, ... or NotRun")
    seconds: float | None = Field(None, description="wall time; None when it never ran")
    summary: str = ""
    device: str = Field("", description="the device its job ran on ('' when no job ran)")


class CostRow(_Model):
    """One stage's jobs (its failed attempts included) and what they cost."""

    stage: str
    instance_type: str
    nodes: int
    jobs: int = 1
    price_per_node_hour: float | None = Field(description="on-demand price; None when unknown")
    billable_seconds: float
    cost_usd: float | None
    service: str | None = Field(None, description="whose price: ec2 (AWS Batch, and the local emulator's "
                                "estimate) or sagemaker (its ml.* price)")
    region: str | None = Field(None, description="the region the catalogue's price is for; None when "
                               "compute.price_per_hour set the price or none is known")
    price_as_of: str | None = Field(None, description="the day the catalogue's price was read (YYYY-MM-DD)")
    on_demand_usd: float | None = Field(
        None, description="spot jobs: what their running time would have cost at the on-demand price (SageMaker "
        "bills a managed spot job's BillableTimeInSeconds, less than its TrainingTimeInSeconds); None for "
        "on-demand jobs")
    instances_started: int | None = Field(
        None, description="cloud instances the stage's jobs started (retries and restarts included); None for "
        "local jobs")
    provisioning_seconds: float | None = Field(
        None, description="how long the stage's jobs waited for the instances they started to be ready (boot, "
        "image pull); None for local jobs")
    forecast_seconds: float | None = Field(None, description="the stage's time as forecast before the run "
                                           "(`trnflow plan`); None when none was made")
    forecast_usd: float | None = Field(None, description="the stage's cost as forecast before the run")


class GoodputLosses(_Model):
    """Where the time a run took to get its final weights went, besides the training they hold (s)."""

    compilation: float = Field(0.0, description="the compile stage, less its instances' provisioning")
    provisioning: float = Field(0.0, description="waiting for the compile and training jobs' instances to be ready")
    checkpoint_stalls: float = Field(0.0, description="what checkpoints stopped training for")
    restarts: float = Field(0.0, description="attempts that failed (their steps after their last checkpoint "
                            "included) and the waits between them")
    rollbacks: float = Field(0.0, description="divergences rolled back: the steps undone and the restores")
    slow_ranks: float = Field(0.0, description="waiting for ranks named slow")
    evaluations: float = Field(0.0, description="the holdout evaluated during training (the gate's points before "
                               "the last step): work asked for, not lost to a fault, but not training")
    other: float = Field(0.0, description="the rest of the final attempt: its launch, reading its data, its first "
                         "step's graphs and the export")


class Goodput(_Model):
    """A run's goodput: the training its final weights hold over the time it took to get them (the
    compile and train stages, retries included), the rest itemized."""

    fraction: float = Field(ge=0, le=1)
    wall_seconds: float = Field(description="the compile and train stages' time, less the final weights' "
                                "evaluation")
    training_seconds: float = Field(description="the training steps the final weights hold, each once")
    losses: GoodputLosses
    final_eval_seconds: float = Field(0.0, description="the holdout's evaluation of the final weights after the "
                                      "last step (the gate's measurement), left out of wall_seconds")

    def __str__(self) -> str:
        lost = ", ".join(f"{name.replace('_', ' ')} {seconds:.1f} s" for name, seconds in self.losses
                         if seconds >= 0.05)
        return (f"{self.fraction:.1%}: {self.training_seconds:.1f} s of training in {self.wall_seconds:.1f} s"
                + (f" ({lost})" if lost else "")
                + (f"; the final weights then evaluated in {self.final_eval_seconds:.1f} s"
                   if self.final_eval_seconds >= 0.05 else ""))


class Cost(_Model):
    rows: list[CostRow] = Field(default_factory=list)
    total_usd: float | None = Field(None, description="None when any instance has no known price")
    forecast_usd: float | None = Field(None, description="the run's cost as forecast before it started")
    instances_started: int | None = Field(None, description="cloud instances the run's jobs started; None when "
                                          "it ran none")
    provisioning_seconds: float | None = Field(None, description="how long the run's jobs waited for their "
                                               "instances to be ready; None when it started none")
    goodput: Goodput | None = Field(None, description="the training the final weights hold over the compile and "
                                    "train stages' time; None before training ended, or when it trained nothing")


QUEUE_ROW = "queue"
"""The stage-table row of a run's time in the queue for its capacity."""


class RunOutcome(_Model):
    """What a flow run ends with."""

    run_id: str | None = None
    stages: list[StageRow] = Field(default_factory=list)
    results: dict[str, SerializeAsAny[StageResult]] = Field(default_factory=dict, description="by stage")
    cost: Cost = Field(default_factory=Cost)
    nothing_new: bool = Field(False, description="scheduled retraining found no new data and launched nothing")
    watermark: str | None = None

    @property
    def waited_seconds(self) -> float:
        """Time it spent in the queue for its capacity (its `queue` rows)."""
        return sum(r.seconds or 0.0 for r in self.stages if r.stage == QUEUE_ROW)

    @property
    def preemptions(self) -> int:
        """How often it yielded its capacity to a higher-priority run (its `Preempted` rows)."""
        return sum(r.state == "Preempted" for r in self.stages)


class DataFileCheck(_Model):
    """One file of a data set as `trnflow data check` read it."""

    name: str = Field(description="the file, relative to its set's URL")
    rows_read: int = Field(0, description="rows a run reads from it")
    rows_rejected: int | None = Field(0, description="rows it holds that no run reads; None when they cannot be "
                                                     "counted (the file cannot be parsed)")
    problem: str | None = Field(None, description="why its rows are rejected")
    rows_cut: int = Field(0, description="rows read that are longer than the model's input and are cut to it")


class DataPartCheck(_Model):
    """One part of a spec's data as `trnflow data check` read it: a day partition of a set, or the
    set's files outside day folders."""

    field: str = Field(description="the spec field: data.train, data.holdout or data.inference")
    url: str = Field(description="the set's URL")
    day: str | None = Field(None, description="the dt=YYYY-MM-DD day; None for files outside day folders")
    state: str = Field(description="ok; failed: a run reading it stops; waiting: not marked ready, not read")
    files: list[DataFileCheck] = Field(default_factory=list, description="each file, read or rejected")
    rows_read: int = Field(0, description="rows a run reads")
    rows_rejected: int = Field(0, description="rows of its files that no run reads (those that can be counted)")
    problems: list[str] = Field(default_factory=list, description="why it failed, or waits")
    notes: list[str] = Field(default_factory=list, description="what a run leaves alone without failing")
    packing: PackingFill | None = Field(None, description="the training rows packed as training packs them "
                                        "(data.packing), when the recipe can count their tokens before training")
