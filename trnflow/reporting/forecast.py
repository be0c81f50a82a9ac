"""How long a run will take and what it will cost, before it starts: a forecast per stage from the
measured history of earlier runs of the same model.

Every completed pipeline run leaves one record of what it measured (`RunRecord`): per stage its
wall time and, where the stage has a rate, its work and rate (training: samples and samples/s;
inference: rows and rows/s), with the layout it ran on (backend, instance type, nodes, cores,
strategy, tensor parallelism). The records live beside the model's registry entries,
`<registry_url>/<model>/history/<run id>.json` (without a registry: `<TRNFLOW_HOME>/history/<model>/`),
one file per run, written once when the run ends.

The forecast of a stage says where it came from:
- `history`: runs of the same recipe on the same layout. Training's time is each run's fixed part
  (its stage time less its samples at its rate: start-up, compile-cache loads, checkpoints) plus
  this spec's samples at that run's rate; the forecast is the median over runs, the range their
  least and most. Inference likewise, for as many rows as the newest run read. Other stages take
  the median of their times.
- `scaled`: no run on this layout, some on others: the rate scaled by the cores, the range wider.
- `calibrated`: no run on this layout, but `trnflow plan --calibrate` timed a few steps of the real
  program on it: training is that job's fixed part plus the samples at its steady step's rate.
- `guess`: no run of this recipe yet: a stated guess, marked as such.
The cost is the forecast time on the stage's nodes at the price `trnflow.reporting.cost` uses.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from trnflow.events import duration
from trnflow.reporting.cost import job_cost
from trnflow.results import CompileResult, Cost, InferResult, RunOutcome, TrainResult
from trnflow.specs import JobSpec
from trnflow.storage import open_store

PIPELINE_STAGES = ("sanity", "collectives", "compile", "train", "evaluate", "infer", "promote")
NO_JOB = ("evaluate", "promote")
"""Stages the orchestrator does itself: they hold no instances."""
GUESS_SECONDS = {"sanity": 30.0, "collectives": 30.0, "compile": 120.0, "evaluate": 10.0, "infer": 60.0,
                 "promote": 5.0}
GUESS_TRAIN_OVERHEAD = 60.0
GUESS_CACHE_LOOKUP = 10.0
"""Seconds a compile stage whose programs are all in the cache takes, before any run measured it."""
GUESS_SAMPLES_PER_CORE_S = 100.0
SCALED_RANGE = (0.6, 1.6)
"""How much wider a rate scaled from another layout may be, low and high."""
CALIBRATED_RANGE = (0.8, 1.5)
"""How much wider a calibration's few steps make the range: a whole run's steps vary more."""


RECORD = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
"""A history record's model: read from a folder other runs write, so every number in it is finite
and every name a plain word (a record that is not is unreadable, and left out)."""
Word = Annotated[str, StringConstraints(pattern=r"^[\w.:/@+-]{1,128}$")]
"""A name in a record (a backend, an instance type, a stage, a run id): letters, digits and `_.:/@+-`,
nothing a terminal or Rich's markup acts on."""


class Layout(BaseModel):
    """What a run ran on: runs on the same layout have comparable rates."""

    model_config = RECORD

    backend: Word
    instance_type: Word
    nodes: int = Field(ge=1)
    cores_per_node: int = Field(ge=1)
    strategy: Word
    tp: int = Field(ge=1)

    @classmethod
    def of(cls, spec: JobSpec) -> Layout:
        parallel = spec.train.parallelism
        return cls(backend=spec.compute.backend, instance_type=spec.compute.instance_type, nodes=spec.compute.nodes,
                   cores_per_node=spec.compute.cores_per_node, strategy=str(parallel.strategy),
                   tp=parallel.tp_degree)

    @property
    def cores(self) -> int:
        return self.nodes * self.cores_per_node

    def describe(self) -> str:
        split = f", tp {self.tp}" if self.tp > 1 else ""
        return (f"{self.backend} {self.nodes}x {self.instance_type}, {self.cores_per_node} cores each, "
                f"{self.strategy}{split}")


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


class RunRecord(BaseModel):
    """What one completed run measured, for the forecasts of later runs, and what was forecast of it."""

    model_config = RECORD

    run_id: Word
    at: float = Field(ge=0, description="when it ended (Unix seconds)")
    recipe: Word
    layout: Layout
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

    def stage(self, name: str) -> StageMeasure | None:
        return next((s for s in self.stages if s.stage == name), None)


def record_of(spec: JobSpec, outcome: RunOutcome, at: float | None = None, forecast: Plan | None = None
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
                     layout=Layout.of(spec), stages=measures, cost_usd=outcome.cost.total_usd,
                     spot=spec.compute.spot, on_demand_usd=None if not rows or None in on_demand else round(
                         sum(c for c in on_demand if c is not None), 4),
                     forecast=forecast.stages if forecast else [],
                     forecast_cost_usd=forecast.cost_usd if forecast else None,
                     queue_wait_s=round(outcome.waited_seconds, 3), preemptions=outcome.preemptions)


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
                     layout=Layout.of(spec), stages=[measure], calibration=True)


def history_url(spec: JobSpec, home: Path) -> str:
    """Where the records of `spec`'s model are kept."""
    if spec.registry_url:
        return f"{spec.registry_url.rstrip('/')}/{spec.name}/history"
    return str(home / "history" / spec.name)


def keep(spec: JobSpec, outcome: RunOutcome, home: Path, forecast: Plan | None = None) -> str | None:
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


# --- the forecast ----------------------------------------------------------------------------------


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: str
    layout: Layout
    stages: list[StageForecast]
    seconds: float
    low: float
    high: float
    cost_usd: float | None = Field(description="on demand; None when an instance has no known price")
    spot_cost_usd: float | None = Field(None, description="a spot spec's cost at what spot saved its earlier spot "
                                        "runs (the median share); None for on-demand specs, or with no spot run yet")
    finish_at: float = Field(description="when it would end if started now (Unix seconds)")
    notes: list[str] = Field(default_factory=list)

    def headline(self) -> str:
        """The one-line total."""
        cost = f"${self.cost_usd:.2f}" if self.cost_usd is not None else "cost unknown (no price)"
        spot = f" (spot about ${self.spot_cost_usd:.2f})" if self.spot_cost_usd is not None else ""
        sources = sorted({s.source for s in self.stages})
        return (f"forecast: {duration(self.seconds)} ({duration(self.low)}-{duration(self.high)}), {cost} "
                f"on-demand{spot}; from {', '.join(sources)}")

    def stage(self, name: str) -> StageForecast | None:
        return next((s for s in self.stages if s.stage == name), None)

    def after(self, name: str) -> list[StageForecast]:
        """The stages forecast after stage `name` (none when it is not one)."""
        names = [s.stage for s in self.stages]
        return self.stages[names.index(name) + 1:] if name in names else []

    @property
    def spot_share(self) -> float:
        """The share of on-demand a spot run is priced at (1.0: on demand)."""
        if self.spot_cost_usd is None or not self.cost_usd:
            return 1.0
        return self.spot_cost_usd / self.cost_usd

    @property
    def expected_cost_usd(self) -> float | None:
        """What the run should cost: on spot, at spot's measured share; else (or with no spot run
        measured yet) on demand, the most it costs."""
        return self.spot_cost_usd if self.spot_cost_usd is not None else self.cost_usd


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def _rated(stage: str, runs: list[RunRecord], work: float | None, cores_ratio: float
           ) -> tuple[float, float, float] | None:
    """Fixed part plus `work` at each run's rate (scaled by `cores_ratio`): median, least, most."""
    predicted = []
    for run in runs:
        measured = run.stage(stage)
        if measured is None or measured.rate is None or measured.work is None:
            continue
        fixed = max(0.0, measured.seconds - measured.work / measured.rate)
        predicted.append(fixed + (measured.work if work is None else work) / (measured.rate * cores_ratio))
    return _spread(predicted) if predicted else None


def _warm_compiles(runs: list[RunRecord]) -> list[float]:
    """The compile times of `runs` that found every program in the cache (none when no run did). A
    run that compiled its programs put them there: the runs after it on the same layout find them,
    and take what the warm ones took (a spec whose programs changed compiles again; `trnflow
    compile --check` says which)."""
    compiles = [m for r in runs if (m := r.stage("compile")) is not None and m.work is not None]
    return [m.seconds for m in compiles if m.work == 0]


def _checked_compile(cache: CompileResult, same: list[RunRecord]) -> tuple[tuple[float, float, float], str]:
    """The compile stage when the cache was asked which programs it holds: the warm runs' time to
    look them up, plus each missing program at the history's time per compiled program (guesses
    where the history has none)."""
    warm = _warm_compiles(same)
    base = _spread(warm) if warm else (GUESS_CACHE_LOOKUP, GUESS_CACHE_LOOKUP / 3, GUESS_CACHE_LOOKUP * 3)
    said = f"compile --check: {cache.misses} of {cache.graphs} program(s) to compile"
    if not cache.misses:
        return base, said + ("; the warm runs' time to look them up" if warm else "; a guess of the time to look "
                             "them up")
    per = [m.seconds / m.work for r in same if (m := r.stage("compile")) is not None and m.work]
    guess = GUESS_SECONDS["compile"] / 3
    each = _spread(per) if per else (guess,) * 3
    low_base = base[1] if warm else 0.0
    found = (base[0] + cache.misses * each[0], low_base + cache.misses * each[1], base[2] + cache.misses * each[2])
    return found, said + (f", at {each[0]:.0f} s each as earlier runs compiled theirs" if per else
                          f", at a guessed {guess:.0f} s each")


def _stage(spec: JobSpec, stage: str, runs: list[RunRecord], layout: Layout, cache: CompileResult | None = None
           ) -> StageForecast:
    same = [r for r in runs if r.layout == layout and not r.calibration]
    others = [r for r in runs if r.layout != layout and not r.calibration]
    timed = [r for r in runs if r.layout == layout and r.calibration]
    samples = float(spec.train.steps * spec.train.global_batch_size)
    work = samples if stage == "train" else None
    found, source, basis = None, "guess", ""
    if stage in ("train", "infer"):
        if same and (found := _rated(stage, same, work, 1.0)):
            source, basis = "history", f"{len(same)} run(s) on this layout"
        elif timed and (calibrated := _rated(stage, timed, work, 1.0)):
            mid, low, high = calibrated
            found = (mid, low * CALIBRATED_RANGE[0], high * CALIBRATED_RANGE[1])
            timed_train = timed[-1].stage("train")
            steps = round(timed_train.work / spec.train.global_batch_size) if timed_train and timed_train.work else 0
            source, basis = "calibrated", f"{steps} timed steps of the real program on this layout"
        elif others:
            newest = others[-1].layout
            scaled = _rated(stage, [r for r in others if r.layout == newest], work, layout.cores / newest.cores)
            if scaled:
                mid, low, high = scaled
                found = (mid, low * SCALED_RANGE[0], high * SCALED_RANGE[1])
                source, basis = "scaled", f"runs on {newest.describe()}, scaled by cores"
    elif stage == "compile" and cache is not None:
        found, basis = _checked_compile(cache, same)
        source = "checked"
    elif stage == "compile" and (warm := _warm_compiles(same)):
        found = _spread(warm)
        source, basis = "history", (f"{len(warm)} run(s) on this layout whose programs were all in the compile "
                                    "cache, as the runs before put them")
    else:
        times = [m.seconds for r in (same or others) if (m := r.stage(stage)) is not None]
        if times:
            found = _spread(times)
            source, basis = ("history" if same else "scaled"), f"{len(times)} run(s)" + ("" if same else
                                                                                       " on other layouts")
    if found is None:
        if stage == "train":
            guess = GUESS_TRAIN_OVERHEAD + samples / (GUESS_SAMPLES_PER_CORE_S * layout.cores)
            basis = (f"no run of this model yet: a guess of {GUESS_SAMPLES_PER_CORE_S:.0f} samples/s per core "
                     f"and {GUESS_TRAIN_OVERHEAD:.0f} s to start")
        else:
            guess = GUESS_SECONDS.get(stage, 30.0)
            basis = "no run of this model yet: a guess"
        found = (guess, guess / 3, guess * 3)
    mid, low, high = found
    nodes = 0 if stage in NO_JOB else 1 if stage == "compile" else spec.compute.nodes
    cost = job_cost(spec, stage, mid, nodes=nodes).cost_usd if nodes else 0.0
    return StageForecast(stage=stage, nodes=nodes, seconds=round(mid, 1), low=round(low, 1), high=round(high, 1),
                         cost_usd=cost, source=source, basis=basis)


def plan(spec: JobSpec, runs: list[RunRecord], now: float | None = None, cache: CompileResult | None = None
         ) -> Plan:
    """The forecast of a pipeline run of `spec` (its layout decided) from the runs of its recipe
    (and, for compile, `cache`: the compile cache's answer to which programs it holds)."""
    mine = [r for r in runs if r.recipe == spec.model.recipe]
    layout = Layout.of(spec)
    real = [r for r in mine if not r.calibration]
    newest = next((r for r in reversed(real) if r.layout == layout), real[-1] if real else None)
    stages = [s.stage for s in newest.stages] if newest else list(PIPELINE_STAGES)
    rows = [_stage(spec, stage, mine, layout, cache) for stage in stages]
    costs = [r.cost_usd for r in rows]
    total = round(sum(r.seconds for r in rows), 1)
    notes = [] if real else ["no earlier run of this model: every figure but a calibrated one is a guess"]
    total_cost = None if any(c is None for c in costs) else round(sum(c or 0.0 for c in costs), 4)
    spot_cost = None
    if spec.compute.spot:
        shares = [r.cost_usd / r.on_demand_usd for r in real if r.spot and r.cost_usd is not None and r.on_demand_usd]
        if shares and total_cost is not None:
            spot_cost = round(total_cost * statistics.median(shares), 4)
            notes.append(f"spot: priced at {statistics.median(shares):.0%} of on-demand, the median share "
                         f"{len(shares)} earlier spot run(s) paid")
        else:
            notes.append("spot: no spot run of this model measured yet; on-demand is the most it costs")
    return Plan(spec=spec.name, layout=layout, stages=rows, seconds=total, low=round(sum(r.low for r in rows), 1),
                high=round(sum(r.high for r in rows), 1),
                cost_usd=total_cost, spot_cost_usd=spot_cost,
                finish_at=(time.time() if now is None else now) + total, notes=notes)


def headline(spec: JobSpec, home: Path) -> str:
    """The one-line forecast of a pipeline run of `spec` (its layout decided), or why none was made.
    Never raises: a forecast is advice, and a history that cannot be listed costs only the forecast."""
    return launch_forecast(spec, home)[1]


# --- the limits ------------------------------------------------------------------------------------

OVERRIDE_HINT = ("raise the limit, or launch anyway with a reason (`trnflow run`/`retrain --override-forecast "
                 "REASON`, or the flow's override_forecast parameter)")


def launch_forecast(spec: JobSpec, home: Path) -> tuple[Plan | None, str]:
    """The forecast of a pipeline run of `spec` (its layout decided) and its one-line total; no
    forecast, and why, when the history cannot be read (no credentials for an s3:// registry, say)."""
    try:
        records, _ = history(spec, home)
        found = plan(spec, records)
    except Exception as exc:  # a forecast is advice: what failed is said, and the limits below fail closed
        return None, f"forecast: none ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    return found, found.headline()


def has_limits(spec: JobSpec) -> bool:
    """Whether the spec sets a deadline or a budget, which its forecast is checked against."""
    return any(limit is not None for limit in (spec.train.max_minutes, spec.compute.max_cost_usd,
                                               spec.train.max_cost_usd))


def over_limits(spec: JobSpec, forecast: Plan | None) -> list[str]:
    """The spec's deadline (`train.max_minutes`) and budgets (`compute.max_cost_usd`,
    `train.max_cost_usd`) that a run forecast as `forecast` would miss, a line each naming the
    field, the figure and where it comes from; a limit that cannot be checked (no forecast, no
    price) is one too. Empty: within them."""
    if not has_limits(spec):
        return []
    if forecast is None:
        return ["the run has a deadline or a budget, and no forecast could be made to check it against (see the "
                "forecast line)"]
    train = forecast.stage("train")
    if train is None:
        return ["the run has a deadline or a budget, and its forecast has no training stage to check it against"]
    problems = []
    if spec.train.max_minutes is not None and train.seconds > spec.train.max_minutes * 60:
        problems.append(f"train.max_minutes: training is forecast to take {duration(train.seconds)} "
                        f"({train.source}: {train.basis}), past its deadline of {spec.train.max_minutes:g} min")
    budget = spec.compute.max_cost_usd
    if budget is not None and forecast.cost_usd is None:
        problems.append(f"compute.max_cost_usd: no price is known for {spec.compute.instance_type} on "
                        f"{spec.compute.backend}, so the budget cannot be held; set compute.price_per_hour")
    elif budget is not None and (expected := forecast.expected_cost_usd) is not None and expected > budget:
        sources = ", ".join(sorted({s.source for s in forecast.stages}))
        priced = "at spot's measured share" if forecast.spot_cost_usd is not None else "on demand"
        problems.append(f"compute.max_cost_usd: the run is forecast to cost ${expected:.4f} {priced} (from "
                        f"{sources}; `trnflow plan` has each stage's), over its budget of ${budget:.4f}")
    cap = spec.train.max_cost_usd
    if cap is not None and train.cost_usd is None:
        problems.append(f"train.max_cost_usd: no price is known for {spec.compute.instance_type} on "
                        f"{spec.compute.backend}, so the budget cannot be held; set compute.price_per_hour")
    elif cap is not None and train.cost_usd is not None and (spent := train.cost_usd * forecast.spot_share) > cap:
        problems.append(f"train.max_cost_usd: training is forecast to cost ${spent:.4f} "
                        f"({train.source}: {train.basis}), over its budget of ${cap:.4f}")
    return problems


def training_budget(spec: JobSpec, forecast: Plan | None, spent_usd: float) -> tuple[float | None, str]:
    """What training may cost (`train.max_cost_usd` for its job) and how that was reckoned: the run's
    budget less what it has spent and the forecast cost of the stages after training, or the spec's
    own cap on training where that is less; (None, "") when neither limit is set. The job counts
    its cost at on-demand prices (it cannot see a spot price), so for a spot run priced at its
    measured share of on-demand the figure is given in on-demand dollars at that share."""
    budget, cap = spec.compute.max_cost_usd, spec.train.max_cost_usd
    if budget is None and cap is None:
        return None, ""
    share = forecast.spot_share if forecast is not None else 1.0
    basis = f"train.max_cost_usd ${cap:.4f}" if cap is not None else ""
    allowance = cap
    if budget is not None:
        later = forecast.after("train") if forecast is not None else []
        after = round(sum(s.cost_usd or 0.0 for s in later) * share, 4)
        left = round(budget - spent_usd - after, 4)
        reckoned = (f"compute.max_cost_usd ${budget:.4f} less ${spent_usd:.4f} spent before training and "
                    f"${after:.4f} forecast for the stages after it")
        if cap is None or left <= cap:
            allowance, basis = left, reckoned
        else:
            basis = f"{basis} (less than {reckoned})"
    assert allowance is not None
    if share < 1.0 and allowance > 0:
        return round(allowance / share, 4), (f"{basis}; ${allowance / share:.4f} at on-demand prices, spot paying "
                                             f"{share:.0%} of them")
    return allowance, basis


def beside(cost: Cost, forecast: Plan | None) -> Cost:
    """The run's cost table with what was forecast of each stage beside what it took and cost."""
    if forecast is None:
        return cost
    rows = [row.model_copy(update={"forecast_seconds": f.seconds, "forecast_usd": f.cost_usd})
            if (f := forecast.stage(row.stage)) else row for row in cost.rows]
    return cost.model_copy(update={"rows": rows, "forecast_usd": forecast.cost_usd})
