"""`trnflow plan`: how long a run of a spec will take and what it will cost, before it starts
(`trnflow.reporting.forecast`)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from trnflow.backends import cache_keys, queue_wait, run_team
from trnflow.backends.calibration import CALIBRATION_STEPS, cache_check, timed_steps
from trnflow.backends.teams import team_of
from trnflow.cli.common import JsonOpt, SetOpt, console, err, load, set_overrides
from trnflow.cli.console import RED, plain
from trnflow.cli.prelaunch import refuse_outside_team
from trnflow.device import plans
from trnflow.device.cache import COMPILER_VERSION
from trnflow.errors import ExitCode, TrnflowError
from trnflow.events import duration
from trnflow.reporting.forecast import plan
from trnflow.reporting.history import RunRecord, RunShape, calibration_record, history
from trnflow.results import CompileResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec
from trnflow.storage.datafiles import listing_problems

CalibrateOpt = Annotated[bool, typer.Option(
    "--calibrate", help=f"With no earlier run on this layout, first train {CALIBRATION_STEPS} steps of the real "
    "program as a job of the spec's backend (the emulator for a local spec) and forecast training from them; and ask "
    "the compile cache which of the spec's programs it holds (a local spec's; without it, the programs an earlier "
    "compile recorded there are looked up, with no job).")]


def plan_command(spec: Annotated[Path, typer.Argument(help="The job spec.")], overrides: SetOpt = None,
                 calibrate: CalibrateOpt = False, as_json: JsonOpt = False) -> None:
    """Forecast a pipeline run of SPEC: per stage, its instances, time (with a range) and cost, and
    where each figure comes from (earlier runs of the model on this layout, a calibration, scaled
    from another layout, or a stated guess); then the total and when it would end if started now."""
    from trnflow.workload.memory import decided  # the memory planner needs the recipe's model: torch

    job = decided(load(spec, set_overrides(overrides)))
    if calibrate:  # a calibration is a job: its team decided, and the spec inside it
        refuse_outside_team(job, str(spec))
    records, unread = history(job, TrnflowSettings().home.expanduser().resolve())
    notes: list[str] = []
    cache = _checked_cache(job, notes) if calibrate else _recorded_cache(job)
    if calibrate and any(r.layout == RunShape.of(job) and r.recipe == job.model.recipe for r in records):
        notes.append("--calibrate: not needed, earlier runs on this layout measured it")
    elif calibrate:
        records.append(_calibrated(job))
    forecast = plan(job, records, cache=cache)
    wait, queued = _queue_note(job, forecast.seconds)
    notes = forecast.notes + notes + [f"left out of the history (unreadable): {line}" for line in unread] + queued
    if as_json:
        print(forecast.model_copy(update={"notes": notes}).model_dump_json(indent=2))
        return
    # the history's words (stage names, other layouts) are printed as plain text, never as markup
    table = Table(title=Text(plain(f"{job.name}: {forecast.layout.describe()}")), title_justify="left")
    for column in ("stage", "nodes", "time", "range", "cost ($)", "from"):
        table.add_column(column, justify="right" if column in ("nodes", "time", "cost ($)") else "left")
    for row in forecast.stages:
        cost = "-" if row.cost_usd is None else f"{row.cost_usd:.4f}"
        table.add_row(*(Text(plain(cell)) for cell in (
            row.stage, str(row.nodes), duration(row.seconds), f"{duration(row.low)}-{duration(row.high)}", cost,
            f"{row.source}: {row.basis}")))
    console.print(table)
    ends = dt.datetime.fromtimestamp(forecast.finish_at + (wait or 0.0)).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    after = f", after about {duration(wait)} in the queue" if wait else ""
    console.print(plain(f"{forecast.headline()}; started now, it ends about {ends}{after}"), markup=False,
                  highlight=False)
    for note in notes:
        err.print(f"note: {plain(note)}", style="dim", markup=False, highlight=False)


def _queue_note(job: JobSpec, seconds: float) -> tuple[float | None, list[str]]:
    """How long the run would wait in its queue now (the runs ahead played forward on their
    forecasts), and a note saying so when any run holds or waits: this machine's queue for a local
    run; for a cloud run, the stack's, when a Prefect server is named (PREFECT_API_URL) to read it on."""
    local, stack = job.compute.backend == "local", None
    if not local:
        from prefect.settings import PREFECT_API_URL  # the Prefect client: only a cloud run's queue needs it

        if not PREFECT_API_URL.value():
            return None, []
        # the stack's queue on that server
        from trnflow.flows._queue import PREFECT_QUEUE

        stack = PREFECT_QUEUE
    try:
        team = team_of("local", TrnflowSettings()) if local else run_team(job)
        wait, why, found = queue_wait(job, team, seconds, stack)
    except TrnflowError:  # whose run it is cannot be told here: `run` says so before its first job
        return None, []
    except Exception as exc:  # the stack's server did not answer: the forecast stands without it
        return None, [f"queue: the stack's queue could not be read ({type(exc).__name__}: {exc})"]
    if not found:
        return None, []
    held = f"{found} runs hold or wait" if found > 1 else "1 run holds or waits"
    held += " for this machine's cores" if local else f" for the stack's {job.compute.instance_type} instances"
    if wait is None:
        return None, [f"queue: {held}; how long this run would wait cannot be told ({why})"]
    return wait, [f"queue: {held}; this run would wait about {duration(wait)} (their forecasts)"]


def _recorded_cache(job: JobSpec) -> CompileResult | None:
    """The compile cache's answer without a job, for a local spec: the programs an earlier compile
    of an equal spec recorded there (`plan_digest`), each looked up among its entries, as the compile
    stage looks before it launches; None when none was recorded, or the spec is not local."""
    if job.compute.backend != "local":
        return None
    from trnflow.workload.recipes import plan_digest  # the recipe's source: torch

    cache = plans.job_cache(job, env={}, keys=cache_keys(job))
    known = plans.recorded(cache, plan_digest(job))
    if known is None:
        return None
    found = plans.predict(known, cache, retry_failed=False)
    hits = sum(row.will == "hit" for row in found)
    return CompileResult(programs=found, graphs=len(found), compiler=COMPILER_VERSION, cache=cache.url, hits=hits,
                         misses=len(found) - hits, launched=False)


def _checked_cache(job: JobSpec, notes: list[str]) -> CompileResult | None:
    """The compile cache's answer to which of the spec's programs it holds (a local spec's: the
    check's job takes its options on this machine only); None, with a note, otherwise."""
    if job.compute.backend != "local":
        notes.append("--calibrate: the compile cache is checked for local specs only; `trnflow compile --check` "
                     "asks it for this one")
        return None
    err.print(f"checking the compile cache {job.compile.cache_url} ...", highlight=False)
    try:
        return cache_check(job)
    except TrnflowError as exc:
        err.print(f"--calibrate: {exc}", **RED)
        raise typer.Exit(ExitCode.FAILED) from None


def _calibrated(job: JobSpec) -> RunRecord:
    """Train the spec's program for a few steps, saying so on stderr; its record (exit 1, saying why,
    when the job fails)."""
    if job.data.train.startswith("file://") and (found := listing_problems(job.data.train, job.data.format,
                                                                           job.data.ready_marker)):
        err.print(f"--calibrate: data.train: {found[0]}", **RED, soft_wrap=True)
        raise typer.Exit(ExitCode.BAD_INPUT)
    err.print(f"calibrating: {CALIBRATION_STEPS} steps of {job.name}'s training program on "
              f"{RunShape.of(job).describe()} ...", highlight=False)
    try:
        result, wall = timed_steps(job)
    except TrnflowError as exc:
        err.print(f"--calibrate: {exc}", **RED)
        raise typer.Exit(ExitCode.FAILED) from None
    err.print(f"calibrated: {result.steps_trained} steps in {wall:.1f} s, median step "
              f"{result.median_step_seconds * 1000:.1f} ms", highlight=False)
    return calibration_record(job, result, wall)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
