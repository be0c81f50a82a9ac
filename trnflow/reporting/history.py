"""What each completed run measured, kept for the forecasts of later runs (`trnflow.reporting.forecast`).

Every completed pipeline run leaves one record of what it measured (`RunRecord`): per stage its
wall time and, where the stage has a rate, its work and rate (training: samples and samples/s;
inference: rows and rows/s), with the layout it ran on (backend, instance type, nodes, cores,
strategy, tensor parallelism). The records live beside the model's registry entries,
`<registry_url>/<model>/history/<run id>.json` (without a registry: `<TRNFLOW_HOME>/history/<model>/`),
one file per run, written once when the run ends.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Annotated, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from trnflow.results import CompileResult, InferResult, RunOutcome, TrainResult
from trnflow.specs import JobSpec
from trnflow.storage import open_store

RECORD = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
"""A history record's model: read from a folder other runs write, so every number in it is finite
and every name a plain word (a record that is not is unreadable, and left out)."""
Word = Annotated[str, StringConstraints(pattern=r"^[\w.:/@+-]{1,128}$")]
"""A name in a record (a backend, an instance type, a stage, a run id): letters, digits and `_.:/@+-`,
nothing a terminal or Rich's markup acts on."""


class RunShape(BaseModel):
    """What a run ran on: runs on the same layout have comparable rates."""

    model_config = RECORD

    backend: Word
    instance_type: Word
    nodes: int = Field(ge=1)
    cores_per_node: int = Field(ge=1)
    strategy: Word
    tp: int = Field(ge=1)
    recompute: Word = Field("none", description="train.activation_checkpointing, decided: a recomputing run's steps "
                            "take longer")

    @classmethod
    def of(cls, spec: JobSpec) -> RunShape:
        """The shape of a run of `spec`, whose layout is decided (`trnflow.workload.memory.decided`)."""
        layout = spec.layout
        return cls(backend=spec.compute.backend, instance_type=spec.compute.instance_type, nodes=spec.compute.nodes,
                   cores_per_node=spec.compute.cores_per_node, strategy=layout.strategy, tp=layout.tp,
                   recompute=layout.recompute)

    @property
    def cores(self) -> int:
        return self.nodes * self.cores_per_node

    def describe(self) -> str:
        split = f", tp {self.tp}" if self.tp > 1 else ""
        recomputed = f", {self.recompute} recomputation" if self.recompute != "none" else ""
        return (f"{self.backend} {self.nodes}x {self.instance_type}, {self.cores_per_node} cores each, "
                f"{self.strategy}{split}{recomputed}")


class StageMeasure(BaseModel):
    model_config = RECORD

    stage: Word
    seconds: float = Field(ge=0, description="the stage's wall time")
    work: float | None = Field(None, ge=0, description="training: samples; inference: rows; compile: programs compiled "
                               "(0: every one was in the cache)")
    rate: float | None = Field(None, gt=0, description="work per second")


class StageForecast(BaseModel):
    model_config = RECORD

    stage: Word
    nodes: int = Field(ge=0, description="instances it holds (0: the orchestrator does it)")
    seconds: float = Field(ge=0)
    low: float = Field(ge=0)
    high: float = Field(ge=0)
    cost_usd: float | None = Field(ge=0)
    source: Literal["history", "checked", "calibrated", "scaled", "guess"]
    basis: str = Field(description="what it rests on, in words")


class Forecasted(Protocol):
    """What was forecast of a run (`trnflow.reporting.forecast.Plan`), as its record keeps it."""

    stages: list[StageForecast]
    cost_usd: float | None


class RunRecord(BaseModel):
    """What one completed run measured, for the forecasts of later runs, and what was forecast of it."""

    model_config = RECORD

    run_id: Word
    at: float = Field(ge=0, description="when it ended (Unix seconds)")
    recipe: Word
    layout: RunShape
    stages: list[StageMeasure]
    cost_usd: float | None = Field(None, ge=0)
    forecast: list[StageForecast] = Field(default_factory=list, description="the forecast made before it started")
    forecast_cost_usd: float | None = Field(None, ge=0)
    calibration: bool = Field(False, description="a few timed steps (`trnflow plan --calibrate`), not a run")
    spot: bool = Field(False, description="its jobs ran on spot capacity")
    on_demand_usd: float | None = Field(None, ge=0, description="its cost at on-demand prices (spot jobs' running time "
                                        "priced on demand); with cost_usd, what spot saved")
    queue_wait_s: float = Field(0.0, ge=0, description="time it waited in the queue for its capacity")
    preemptions: int = Field(0, ge=0, description="how often it yielded its capacity to a higher-priority run")
    goodput: float | None = Field(None, ge=0, le=1, description="the training its final weights hold over its "
                                  "compile and train stages' time (`Goodput`)")

    def stage(self, name: str) -> StageMeasure | None:
        return next((s for s in self.stages if s.stage == name), None)


def record_of(spec: JobSpec, outcome: RunOutcome, at: float | None = None, forecast: Forecasted | None = None
              ) -> RunRecord:
    """The record of a run that completed (`spec` as it ran: its layout decided), with `forecast`,
    what was forecast of it."""
    assert outcome.run_id is not None
    measures = []
    for row in outcome.stages:
        if row.state != "Completed" or row.seconds is None:
            continue
        result = outcome.results.get(row.stage)
        work = rate = None
        if isinstance(result, TrainResult) and result.steps_trained and result.samples_per_s > 0:
            work, rate = float(result.steps_trained * spec.train.global_batch_size), steady_rate(spec, result)
        elif isinstance(result, InferResult) and result.rows_embedded and result.rows_per_s > 0:
            work, rate = float(result.rows_embedded), result.rows_per_s
        elif isinstance(result, CompileResult):
            work = float(result.compiled)
        measures.append(StageMeasure(stage=row.stage, seconds=row.seconds, work=work, rate=rate))
    rows = outcome.cost.rows
    on_demand = [r.on_demand_usd if r.on_demand_usd is not None else r.cost_usd for r in rows]
    return RunRecord(run_id=outcome.run_id, at=time.time() if at is None else at, recipe=spec.model.recipe,
                     layout=RunShape.of(spec), stages=measures, cost_usd=outcome.cost.total_usd,
                     spot=spec.compute.spot, on_demand_usd=None if not rows or None in on_demand else round(
                         sum(c for c in on_demand if c is not None), 4),
                     forecast=forecast.stages if forecast else [],
                     forecast_cost_usd=forecast.cost_usd if forecast else None,
                     queue_wait_s=round(outcome.waited_seconds, 3), preemptions=outcome.preemptions,
                     goodput=outcome.cost.goodput.fraction if outcome.cost.goodput else None)


def steady_rate(spec: JobSpec, result: TrainResult) -> float:
    """Training's samples/s at its steady step (the median after the first, which loads or compiles
    the graph): what more steps add. The rest of the stage's time, the first step's extra included,
    is its fixed part. A run of one step has only its overall rate."""
    if result.median_step_seconds > 0:
        return round(spec.train.global_batch_size / result.median_step_seconds, 3)
    return result.samples_per_s


def calibration_record(spec: JobSpec, result: TrainResult, wall_seconds: float) -> RunRecord:
    """A calibration job (`trnflow.backends.calibration.timed_steps`) as a record of `spec`'s layout: its wall
    time, and its samples at the rate of its steady steps (the median step after the first), so
    that the forecast's fixed part holds its start-up, first step and final checkpoint."""
    measure = StageMeasure(stage="train", seconds=round(wall_seconds, 3),
                           work=float(result.steps_trained * spec.train.global_batch_size),
                           rate=steady_rate(spec, result))
    return RunRecord(run_id=result.run_id or "calibration", at=time.time(), recipe=spec.model.recipe,
                     layout=RunShape.of(spec), stages=[measure], calibration=True)


def history_url(spec: JobSpec, home: Path) -> str:
    """Where the records of `spec`'s model are kept."""
    if spec.registry_url:
        return f"{spec.registry_url.rstrip('/')}/{spec.name}/history"
    return str(home / "history" / spec.name)


def keep(spec: JobSpec, outcome: RunOutcome, home: Path, forecast: Forecasted | None = None) -> str | None:
    """Add a completed run's record (with `forecast`, what was forecast of it) to its model's
    history: where it went (None: it trained nothing, as a retraining run that found no new data;
    its times say nothing of a run that does)."""
    train = outcome.results.get("train")
    if not (isinstance(train, TrainResult) and train.steps_trained):
        return None
    record = record_of(spec, outcome, forecast=forecast)
    where = history_url(spec, home)
    open_store(where).write(f"{record.run_id}.json", record.model_dump_json(indent=1).encode())
    return f"{where}/{record.run_id}.json"


def history(spec: JobSpec, home: Path) -> tuple[list[RunRecord], list[str]]:
    """The model's records, oldest first, and a line for each file that could not be read (it is
    left out: a forecast is advice, and says what it rests on)."""
    store = open_store(history_url(spec, home))
    records, unread = [], []
    with contextlib.suppress(FileNotFoundError):
        for item in store.list():
            if not item.name.endswith(".json") or "/" in item.name:
                continue
            try:
                records.append(RunRecord.model_validate_json(store.read(item.name)))
            except (ValidationError, ValueError, OSError) as exc:
                unread.append(f"{item.name}: {type(exc).__name__}")
    return sorted(records, key=lambda r: r.at), unread
