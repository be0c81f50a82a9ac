"""How long a run will take and what it will cost, before it starts: a forecast per stage from the
measured history of earlier runs of the same model (`trnflow.reporting.history`). The limits a
forecast is checked against are `trnflow.reporting.budget`'s.

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

import statistics
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from trnflow.events import duration
from trnflow.reporting.cost import job_cost
from trnflow.reporting.history import RunRecord, RunShape, StageForecast, history
from trnflow.results import CompileResult, Cost
from trnflow.specs import JobSpec

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





# --- the forecast ----------------------------------------------------------------------------------


class Plan(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    spec: str
    layout: RunShape
    stages: list[StageForecast]
    seconds: float
    low: float
    high: float
    cost_usd: float | None = Field(description="on demand; None when an instance has no known price")
    spot_cost_usd: float | None = Field(None, description="a spot spec's cost at what spot saved its earlier spot "
                                        "runs (the median share); None for on-demand specs, or with no spot run yet")
    finish_at: float = Field(description="when it would end if started now (Unix seconds)")
    goodput: float | None = Field(None, description="the median goodput of earlier runs of the model (on this layout "
                                  "where there are some): a forecast of training not measured by runs on this "
                                  "layout is divided by it; None with none measured")
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
    asked = "compile --check" if cache.launched else "the compile cache (the programs an earlier compile recorded)"
    said = f"{asked}: {cache.misses} of {cache.graphs} program(s) to compile"
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


def _stage(spec: JobSpec, stage: str, runs: list[RunRecord], layout: RunShape, cache: CompileResult | None = None
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
    layout = RunShape.of(spec)
    real = [r for r in mine if not r.calibration]
    newest = next((r for r in reversed(real) if r.layout == layout), real[-1] if real else None)
    stages = [s.stage for s in newest.stages] if newest else list(PIPELINE_STAGES)
    rows = [_stage(spec, stage, mine, layout, cache) for stage in stages]
    measured = [r.goodput for r in real if r.goodput and r.layout == layout] or [r.goodput for r in real if r.goodput]
    good = statistics.median(measured) if measured else None
    if good:  # an ideal time (timed steps, scaled rates, a guess) loses what earlier runs lost
        rows = [r.model_copy(update={"seconds": round(r.seconds / good, 1), "low": round(r.low / good, 1),
                                     "high": round(r.high / good, 1), "basis": f"{r.basis}, at {good:.0%} goodput",
                                     "cost_usd": job_cost(spec, r.stage, r.seconds / good, nodes=r.nodes).cost_usd
                                     if r.nodes else 0.0})
                if r.stage == "train" and r.source != "history" else r for r in rows]
    costs = [r.cost_usd for r in rows]
    total = round(sum(r.seconds for r in rows), 1)
    notes = [] if real else ["no earlier run of this model: every figure but a calibrated one is a guess"]
    if good:
        notes.append(f"goodput {good:.1%}: the median of {len(measured)} earlier run(s) (the training their final "
                     "weights hold, over their compile and train stages' time)")
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
                cost_usd=total_cost, spot_cost_usd=spot_cost, goodput=good,
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


def beside(cost: Cost, forecast: Plan | None) -> Cost:
    """The run's cost table with what was forecast of each stage beside what it took and cost."""
    if forecast is None:
        return cost
    rows = [row.model_copy(update={"forecast_seconds": f.seconds, "forecast_usd": f.cost_usd})
            if (f := forecast.stage(row.stage)) else row for row in cost.rows]
    return cost.model_copy(update={"rows": rows, "forecast_usd": forecast.cost_usd})
