"""What a job measured and found on its hardware, as types: each core's known-answer checks and the
host's device list, a collective sweep's rows and what each collective's plan costs, the memory a
layout needs and what the ranks held, a compile plan's graphs and what became of each. The stage
results (`trnflow.results`) carry them; the tools' own formats keep their names where they are
stored (a sweep row is written under nccom-test's columns and read by attribute).
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, JsonValue


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GraphSeen(_Model):
    """One graph a job's compile backend met (a recompilation, as `CompileMetrics` keeps them)."""

    program: str = Field(description="the program that traced it")
    key: str = Field(description="its compile cache key")
    outcome: str = Field(description="extracted, compiled, hit or recompiled")
    reason: str = Field("", description="why it was compiled: not in the cache, a new shape, ...")
    shapes: str = Field("", description="its input shapes")
    seconds: float = Field(0.0, ge=0, description="its compile time")


class PlanSummary(_Model):
    """What one collective's plan costs over a job's cores (`trnflow.neuron.plan`), for a stage to report."""

    op: str = Field(description="the collective: all_reduce, all_gather, reduce_scatter, ...")
    algorithm: str = Field(description="ring or tree")
    ranks: int = Field(ge=1, description="the ranks it runs over")
    nodes: int = Field(ge=1, description="the instances they are on")
    size: int = Field(ge=0, description="the buffer's bytes")
    steps: int = Field(ge=0, description="every phase's steps together")
    crossing_steps: int = Field(ge=0, description="steps with a send from one node to another")
    network_hops: int = Field(ge=0, description="times the order crosses from one node to the next in one pass")
    bytes_per_rank: int = Field(ge=0, description="bytes the busiest rank sends")
    bus_factor: float = Field(ge=0, description="bus bandwidth over algorithm bandwidth")

    def line(self) -> str:
        """One line for a report: `all_reduce ring on 2048 ranks (64 node(s)): 4094 steps, 4094 crossing nodes, ...`."""
        return (f"{self.op} {self.algorithm} on {self.ranks} ranks ({self.nodes} node(s)): {self.steps} steps, "
                f"{self.crossing_steps} crossing nodes, {self.bytes_per_rank} B sent per rank of {self.size} B, "
                f"bus factor {self.bus_factor:.4f}")


NCCOM_TIME_COLUMNS = ("time:avg(us)", "time(us)")
"""nccom-test's time column, newest spelling first: `time(us)` in older versions, and in rows an
older trnflow stored. A `SweepRow` reads either and writes the first."""


class SweepRow(BaseModel):
    """One size of one collective in a sweep, as nccom-test reports it: stored under nccom-test's own
    column names (`size(B)`, `time:avg(us)`, `busbw(GB/s)`, ...), read under either spelling of
    its time column (`time(us)` in older versions and rows), used by attribute."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    op: str = Field(description="all_reduce, all_gather, reduce_scatter or all_to_all")
    size: int = Field(alias="size(B)", ge=0, description="the buffer's bytes")
    count: int = Field(0, alias="count(elems)", ge=0, description="its elements")
    type: str = Field("", description="their data type")
    time_us: float = Field(alias="time:avg(us)", validation_alias=AliasChoices(*NCCOM_TIME_COLUMNS, "time_us"),
                           description="the mean time of the timed iterations, in microseconds")
    algbw: float = Field(0.0, alias="algbw(GB/s)", description="algorithm bandwidth: bytes over time")
    busbw: float = Field(0.0, alias="busbw(GB/s)", description="bus bandwidth: algbw times the op's bus factor")
    correct: bool | None = Field(None, description="the checked result was right; None when nothing checked it")
    bad_cores: list[int] = Field(default_factory=list, description="cores that sent corrupted data")

    @property
    def verdict(self) -> str:
        """ok, WRONG, or `-` when nothing checked it (nccom-test run without -c says nothing)."""
        return {True: "ok", False: "WRONG"}.get(self.correct, "-")


class CoreHolder(_Model):
    """A process the host's device list shows holding one of the job's cores."""

    pid: int | None = Field(description="its process id")
    command: str = Field(description="its command, as neuron-ls lists it")


class HostInventory(_Model):
    """The host's device list (`neuron-ls --json-output`, or the emulated instance's) against the
    job's cores (`trnflow.neuron.tools.inventory`)."""

    source: str = Field("", description="what listed them: neuron-ls, or emulator")
    devices: int = Field(ge=0, description="Neuron devices listed")
    cores: int = Field(ge=0, description="NeuronCores listed")
    missing: list[int] = Field(default_factory=list, description="the job's cores the list lacks (each one bad)")
    held: dict[int, CoreHolder] = Field(default_factory=dict, description="the job's cores another process holds")


class MemoryFigures(_Model):
    """What each core must hold to train a spec on its layout, as the memory planner reckons it
    (`trnflow.workload.memory`), in bytes. Made by `of`, which sums the total and checks it fits."""

    strategy: str = Field(description="ddp or fsdp")
    parameters: int = Field(ge=0, description="the model's parameters")
    weights: int = Field(ge=0, description="the weights one core keeps: all of them (ddp), or its 1/N shard (fsdp)")
    gradients: int = Field(ge=0, description="the gradients one core keeps (of the weights that train: a frozen "
                           "LoRA base has none), as the optimizer's state")
    optimizer: int = Field(ge=0, description="the optimizer state one core keeps")
    activations: int = Field(ge=0, description="the activations one step saves for its backward pass")
    recomputed: str = Field("none", description="train.activation_checkpointing as the activations count it: none, "
                            "selective or full (what the recipe could reckon; none when it could not)")
    gathered: int = Field(ge=0, description="fsdp: the weights gathered whole while they compute (the unit outside "
                          "the blocks, and the largest block twice: the one computing and the next, prefetched); 0 "
                          "for ddp")
    per_core_limit: int = Field(ge=0, description="what one core has")
    tp: int = Field(1, ge=1, description="the cores each layer is split over: the split layers' weights, gradients "
                    "and optimizer state are 1/tp of theirs on each core")
    rehearsal: bool = Field(False, description="the limit is a rehearsal's (TRNFLOW_REHEARSE_CORE_GIB)")
    trainable: int | None = Field(None, description="parameters that train, when fewer than all (LoRA)")
    total: int = Field(ge=0, description="what one core must hold")
    fits: bool = Field(description="the total is within the limit")

    @classmethod
    def of(cls, strategy: str, parameters: int, weights: int, gradients: int, optimizer: int, activations: int,
           gathered: int, per_core_limit: int, tp: int = 1, rehearsal: bool = False,
           trainable: int | None = None, recomputed: str = "none") -> MemoryFigures:
        """The figures of one layout, their total and whether it fits."""
        total = weights + gradients + optimizer + activations + gathered
        return cls(strategy=strategy, parameters=parameters, weights=weights, gradients=gradients,
                   optimizer=optimizer, activations=activations, recomputed=recomputed, gathered=gathered,
                   per_core_limit=per_core_limit, tp=tp, rehearsal=rehearsal, trainable=trainable, total=total,
                   fits=total <= per_core_limit)

    @property
    def layout(self) -> str:
        """`fsdp`, or `fsdp tp 2` with the layers split."""
        return self.strategy + (f" tp {self.tp}" if self.tp > 1 else "")

    def describe(self) -> str:
        """`fsdp 1.2 GiB of 16.0 GiB (weights 300.0 MiB, gradients ..., gathered 100.0 MiB)`."""
        recomputed = f" ({self.recomputed} recomputation)" if self.recomputed != "none" else ""
        parts = [("weights", self.weights), ("gradients", self.gradients), ("optimizer", self.optimizer),
                 (f"activations{recomputed}", self.activations)] + \
            ([("gathered", self.gathered)] if self.strategy == "fsdp" else [])
        trains = (f", {self.trainable:,} of {self.parameters:,} parameters train "
                  f"({self.trainable / max(self.parameters, 1):.2%})" if self.trainable is not None else "")
        return (f"{self.layout} {byte_size(self.total)} of {byte_size(self.per_core_limit)}"
                f"{' (rehearsal)' if self.rehearsal else ''} ("
                + ", ".join(f"{name} {byte_size(value)}" for name, value in parts) + trains + ")")


def byte_size(value: int) -> str:
    """`1.2 GiB`, or `300.0 MiB` under a GiB."""
    return f"{value / 2**30:.1f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


class EngineCheck(_Model):
    """One known-answer test on one engine of a core (`trnflow.workload.sanity`)."""

    engine: str = Field(description="tensor, vector, scalar, gpsimd or memory")
    test: str = Field(description="what ran: matmul, layernorm, exp, segmented_prefix_sum, patterns, ...")
    dtype: str = Field(description="the data type it ran in")
    passed: bool = Field(description="within its tolerance of the host's answer")
    tolerance: float = Field(description="the largest error allowed (relative, or mismatches)")
    us: float = Field(description="how long it took, in microseconds")
    max_rel_err: float | None = Field(None, description="the largest relative error against the host's answer")
    mismatches: int | None = Field(None, description="elements that differ from the known answer (exact tests)")
    bytes: int | None = Field(None, description="the memory it wrote and read back")
    gflops: float | None = Field(None, description="the matmul's rate")

    @property
    def name(self) -> str:
        """`tensor/matmul/bfloat16`."""
        return f"{self.engine}/{self.test}/{self.dtype}"


class CoreChecks(_Model):
    """One core's known-answer tests, as its rank ran them."""

    rank: int | None = Field(None, description="the rank that ran them (its node is rank // cores per node)")
    core: int = Field(description="the NeuronCore")
    pid: int | None = Field(None, description="the rank's process, which held the core")
    checks: list[EngineCheck] = Field(default_factory=list, description="each test")
    passed: bool = Field(description="every test passed")
    failed: list[str] = Field(default_factory=list, description="the tests that failed, as engine/test/dtype")


class ProgramPlan(_Model):
    """One graph of a spec's compile plan (`trnflow.device.plans`): its program, cache key and input
    shapes; once predicted against a cache, its entry's state and what compiling will do."""

    program: str = Field(description="the program it belongs to: train_step, eval_step, embed_step, ...")
    key: str = Field(description="its compile cache key")
    shapes: str = Field("", description="its input shapes")
    state: str | None = Field(None, description="its cache entry's state: done, failed, locked, corrupt or missing")
    will: str | None = Field(None, description="what compiling will do: hit, compile, skip (failed before) or wait "
                             "(being compiled)")


class ProgramOutcome(_Model):
    """What a compile job did with one graph, as neuron_parallel_compile's report says it."""

    program: str = Field(description="the program it belongs to")
    key: str = Field(description="its compile cache key")
    status: Literal["hit", "done", "failed", "locked"] = Field(description="hit: the cache held it; done: compiled "
                                                                  "now; failed; locked: another process held it")
    seconds: float = Field(0.0, ge=0, description="its share of the compile time")
    retries: int = Field(0, ge=0, description="compiles of it retried")
    cached_failure: bool = Field(False, description="failed before, and not retried (--retry-failed retries it)")
    waited: bool = Field(False, description="another process compiled it while this one waited for its lock")
    owner: dict[str, JsonValue] | None = Field(None, description="the lock's record of the process that held it "
                                               "(pid, host, since)")
    together: int | None = Field(None, description="graphs one run of its program compiled, it included")
    stale_lock_cleared: bool = Field(False, description="a lock whose process was gone was cleared first")


class ParallelCompile(_Model):
    """What the SDK's neuron_parallel_compile reported, where it ran the trial first."""

    tool: str = Field(description="the tool that ran")
    workers: int = Field(ge=1, description="graphs it compiled at a time")
    graphs: int | None = Field(None, description="graphs it found")
    compiled: int | None = Field(None, description="graphs it compiled")
    failed: int | None = Field(None, description="graphs it failed to compile")


class HostMemory(_Model):
    """What a job's ranks held in host memory: their peak resident set (the rows are read a batch
    at a time), and whether the featurized rows went to local disk."""

    peak_rss_mb_per_rank: list[float] = Field(description="each rank's peak resident set, in MB")
    rows: int = Field(ge=0, description="the rows featurized")
    features_spilled_to_disk: bool = Field(description="the featurized rows were spilled to local disk")


class DeviceMemory(_Model):
    """What rank 0 held on its device for a training step, measured, beside the planner's estimate."""

    estimated_per_core: int = Field(ge=0, description="the memory planner's total for one core")
    peak_per_rank: list[int] = Field(description="each rank's measured total")
    weights: int = Field(0, ge=0, description="the weights rank 0 held")
    gradients: int = Field(0, ge=0, description="its gradients")
    optimizer: int = Field(0, ge=0, description="its optimizer state")
    activations: int = Field(0, ge=0, description="the activations its step saved for the backward pass")
    total: int = Field(0, ge=0, description="all of them")
