"""`trnflow reference`, `compile`, `run`, `retrain` and `preflight`: the pipeline and its parts, run
now in this process on Prefect's local API (flows) or straight on a backend (the reference and the
ahead-of-time compile). Prefect is imported only when a flow is about to run."""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trnflow.backends import JobRequest, JobState, backend_for, run_to_end
from trnflow.backends.reference import run_reference
from trnflow.cli import render
from trnflow.cli.common import JsonOpt, SetOpt, SpecArg, console, err, load, set_overrides
from trnflow.cli.console import RED
from trnflow.cli.prelaunch import OverrideOpt, refuse_outside_team, refuse_over_forecast, refuse_unlaunchable
from trnflow.cli.progress import job_progress, training_progress
from trnflow.errors import ChampionKept, ExitCode, GateFailed, OverBudget, TrnflowError
from trnflow.lifecycle.references import reference_url
from trnflow.neuron.compile_log import CompileProgress
from trnflow.reporting.chart import paired_sentence
from trnflow.results import (
    CollectivesResult,
    CompileResult,
    EvaluateResult,
    RunOutcome,
    SanityResult,
    StageResult,
)
from trnflow.settings import TrnflowSettings
from trnflow.specs import RETRAINED, JobSpec, new_run_id, run_id_problem


def reference(spec_path: SpecArg, overrides: SetOpt = None):
    """Train the spec in plain fp32 (as a GPU run would) and write its metrics to gate.reference."""

    spec = load(spec_path, set_overrides(overrides))
    refuse_outside_team(spec, str(spec_path), writes_reference=True)
    try:
        with job_progress(err, "reference") as follow:
            document = run_reference(spec, on_logs=follow)
    except TrnflowError as exc:
        err.print(f"{exc}", **RED)
        raise typer.Exit(ExitCode.FAILED) from None
    final = document.last
    console.print(f"reference written to {reference_url(spec)}: step {final.step}, "
                  f"{spec.gate.metric} {final.value(spec.gate.metric):.4f}")


def compile_cmd(
    spec_path: SpecArg,
    check: Annotated[bool, typer.Option("--check", help="Only say which graphs would hit or miss; compile nothing.")
                     ] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Compile entries that failed before.")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Compile the spec's programs ahead of time into the persistent cache (like neuron_parallel_compile)."""

    spec = load(spec_path, set_overrides(overrides))
    settings = TrnflowSettings()
    refuse_outside_team(spec, str(spec_path))  # the cache it writes must be its team's
    options = {"check": check, "retry_failed": retry_failed}
    columns = (TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=as_json) as progress:
        bar = progress.add_task("extracting graphs", total=None)

        def follow(text: str) -> None:
            for p in CompileProgress.each_in(text):
                progress.update(bar, total=p.total, completed=p.done + p.failed,
                                description=f"locked {p.locked}, failed {p.failed}")

        try:
            backend = backend_for(spec, settings)
            request = JobRequest(spec, "compile", "compile", processes=1, options=options)
            _, info = run_to_end(backend, request, settings.poll_seconds, on_logs=follow)
        except TrnflowError as exc:
            err.print(f"{exc}", **RED)
            raise typer.Exit(ExitCode.FAILED) from None
    if info.state is not JobState.SUCCEEDED or info.result is None:
        if as_json:
            print(json.dumps({"state": "Failed", "error": info.failure.message if info.failure else info.failed()}))
        err.print(info.failed(), **RED)
        raise typer.Exit(ExitCode.FAILED)
    result = info.result
    assert isinstance(result, CompileResult)
    if as_json:
        print(result.model_dump_json(indent=2))
        return
    table = Table("program", "input shapes", "key", "state", "outcome", title=f"compile cache {result.cache}")
    for row in result.programs:
        done = result.report.get(row.key)
        outcome = row.will if check else f"{done.status} ({done.seconds:.1f}s)" if done else "?"
        table.add_row(row.program, row.shapes, row.key, row.state, outcome)
    console.print(table)
    if result.parallel_compile:
        totals = result.parallel_compile
        console.print(f"{totals.tool} compiled {'?' if totals.compiled is None else totals.compiled} of "
                      f"{'?' if totals.graphs is None else totals.graphs} graph(s), {totals.workers} at a time, "
                      "before trnflow recorded them")
    if check:
        console.print(f"{result.hits} hit(s), {result.misses} miss(es)")


def _check_run_id(run_id: str | None) -> None:
    """Refuse a run id that could not name a checkpoint folder, before anything starts."""
    if run_id is not None and (problem := run_id_problem(run_id)):
        err.print(f"--run-id {problem}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)


def resume_command(run_id: str, argv: list[str] | None = None) -> str:
    """The command line that runs this command again on the same run id, which resumes it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--run-id" not in args and not any(a.startswith("--run-id=") for a in args):
        args += ["--run-id", run_id]
    return shlex.join(["trnflow", *args])


@contextlib.contextmanager
def _resumable(run_id: str) -> Iterator[None]:
    """On Ctrl-C or SIGTERM, say which run stopped and the command that resumes it, then exit 130."""
    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        yield
    except KeyboardInterrupt:
        err.print(f"interrupted: run {run_id} stopped; its committed checkpoints are kept. Resume it with:", **RED)
        err.print(f"  {resume_command(run_id)}", soft_wrap=True, markup=False, highlight=False)  # one line to copy
        raise typer.Exit(ExitCode.INTERRUPTED) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _gate_notes(results: dict[str, StageResult]) -> None:
    """The gate's paired test in plain words, under the stage table."""
    evaluated = results.get("evaluate")
    verdict = evaluated.verdict if isinstance(evaluated, EvaluateResult) else None
    if not verdict:
        return
    for who, check in verdict.each().items():
        if check.paired:
            label = f"against {who}: " if who else ""
            console.print(f"{label}{paired_sentence(check)}", highlight=False)


def _exit_code(cause: BaseException) -> ExitCode:
    if isinstance(cause, GateFailed):
        return ExitCode.GATE_FAILED
    if isinstance(cause, OverBudget):
        return ExitCode.OVER_BUDGET
    return ExitCode.CHAMPION_KEPT if isinstance(cause, ChampionKept) else ExitCode.FAILED


ForceOpt = Annotated[bool, typer.Option("--force-promote", help="Promote the candidate even if it is worse than the "
                                        "champion (it must still pass the gate); needs --reason.")]
ReasonOpt = Annotated[str | None, typer.Option("--reason", help="Why --force-promote: recorded in the registry.")]


def _forced(force: bool, reason: str | None) -> dict[str, str]:
    """The flow parameter for --force-promote, refusing it without a reason."""
    if reason and not force:
        err.print("--reason goes with --force-promote: it records why a worse candidate was promoted", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    if not force:
        return {}
    if not (reason or "").strip():
        err.print('--force-promote needs --reason "why": the registry records it with the promotion', **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    return {"force_promote": reason.strip()}


def _run_flow(flow_fn, stages: tuple[str, ...], title: str, spec: JobSpec, run_id: str | None, as_json: bool,
              show=None, **params) -> None:
    """Run a flow in-process on Prefect's local API; print its stage table; exit with its outcome."""
    from trnflow.flows._stages import PipelineFailed  # heavy: prefect

    run_id = run_id or new_run_id()  # known before anything starts, so an interrupt can name it
    with training_progress(err, enabled=not as_json and err.is_terminal), _resumable(run_id):
        state = flow_fn(spec, run_id=run_id, return_state=True, **params)
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, PipelineFailed):
        rows, code = outcome.stages, _exit_code(outcome.cause)
        payload = {"state": "Failed", "failed_stage": outcome.stage, "error": str(outcome.cause),
                   "stages": [r.model_dump(mode="json") for r in rows]}
    elif not isinstance(outcome, RunOutcome):  # the flow raised before any stage, or between two
        rows, code = [], _exit_code(outcome) if isinstance(outcome, BaseException) else ExitCode.FAILED
        payload = {"state": "Failed", "error": f"{type(outcome).__name__}: {outcome}", "stages": []}
    elif outcome.nothing_new:  # scheduled retraining with no new data: no job was launched
        payload = {"state": "Completed", "nothing_new": True, "message": state.message, "stages": []}
        if as_json:
            print(json.dumps(payload, indent=2))
        else:
            console.print(f"[cyan]{title}: {state.message}[/cyan]")
        raise typer.Exit(ExitCode.OK)
    else:
        rows, code = outcome.stages, 0
        payload = {"state": "Completed", **outcome.model_dump(mode="json", exclude={"nothing_new", "watermark"})}
    if as_json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        if show and code == 0:
            show(outcome.results)
        console.print(render.stage_table(rows, stages, title))
        if code == 0 and outcome.cost.rows:
            console.print(render.cost_table(outcome.cost))
        if code == 0:
            _gate_notes(outcome.results)
        if code:
            err.print(f"{title} failed: {payload['error']}", **RED)
        else:
            console.print(f"[green]{title} completed[/green] (run {payload['run_id']})")
    raise typer.Exit(code)


def _before_launch(spec_path: Path, overrides: list[str] | None, extra: dict[str, str], run_id: str | None,
                   force_promote: bool, reason: str | None, override_forecast: str | None,
                   retraining: bool = False) -> tuple[JobSpec, dict[str, str]]:
    """What `run` and `retrain` check before their flow starts, exiting 2 on a user's mistake: the
    flags, the run id, the spec (with --set and `extra`), what would stop the run from launching,
    and its forecast against its limits. The spec, and the flow's --force-promote parameter."""
    forced = _forced(force_promote, reason)
    _check_run_id(run_id)
    spec = load(spec_path, {**set_overrides(overrides), **extra})
    if retraining:
        if spec.registry_url is None:
            err.print(f"{spec_path}: registry_url: retraining keeps its champion and watermark in a model "
                      "registry; set registry_url", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        load(spec_path, {**set_overrides(overrides), **RETRAINED})  # as the flow runs it: from the champion's
    refuse_unlaunchable(spec, str(spec_path), retraining=retraining)
    refuse_over_forecast(spec, str(spec_path), override_forecast)
    return spec, forced


def run(
    spec_path: SpecArg,
    backend: Annotated[str | None, typer.Option(help="Override compute.backend: local, sagemaker or batch.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Resume or name a run (default: a new id).")] = None,
    overrides: SetOpt = None,
    force_promote: ForceOpt = False,
    reason: ReasonOpt = None,
    override_forecast: OverrideOpt = None,
    as_json: JsonOpt = False,
):
    """Run the whole pipeline now, in this process, on Prefect's local API. A candidate worse than
    the champion is registered but not promoted (exit 5); training stopped by its budget ends the
    run OverBudget (exit 6), resumable with the same --run-id and a higher budget."""
    extra = {"compute.backend": backend} if backend else {}
    spec, forced = _before_launch(spec_path, overrides, extra, run_id, force_promote, reason, override_forecast)
    from trnflow.flows.pipeline import STAGES, pipeline  # heavy: prefect and torch

    _run_flow(pipeline, STAGES, "trnflow pipeline", spec, run_id, as_json, override_forecast=override_forecast,
              **forced)


def retrain(
    spec_path: SpecArg,
    run_id: Annotated[str | None, typer.Option(help="Resume or name a run (default: a new id).")] = None,
    overrides: SetOpt = None,
    force_promote: ForceOpt = False,
    reason: ReasonOpt = None,
    override_forecast: OverrideOpt = None,
    as_json: JsonOpt = False,
):
    """Retrain the champion on the data after its watermark now, in this process (as the schedule does)."""
    spec, forced = _before_launch(spec_path, overrides, {}, run_id, force_promote, reason, override_forecast,
                                  retraining=True)
    from trnflow.flows.incremental_retrain import STAGES, incremental_retrain  # heavy: prefect and torch

    _run_flow(incremental_retrain, STAGES, "trnflow retrain", spec, run_id, as_json,
              override_forecast=override_forecast, **forced)


def infer(
    spec_path: SpecArg,
    model: Annotated[str, typer.Option("--model", help="The registered version to use: champion, or a version "
                                       "number (`trnflow models ls`).")] = "champion",
    checkpoint: Annotated[str | None, typer.Option(help="Use this checkpoint instead of a registered version "
                                                   "(its outputs go to inference.output_url itself).")] = None,
    run_id: Annotated[str | None, typer.Option(help="Resume or name a run (default: a new id).")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Run the inference set through a model now: into that version's own output folder, published as
    current when it is the champion."""
    _check_run_id(run_id)
    spec = load(spec_path, set_overrides(overrides))
    from trnflow.flows.batch_inference import STAGES, batch_inference  # heavy: prefect and torch

    _run_flow(batch_inference, STAGES, "trnflow infer", spec, run_id, as_json, model=model, checkpoint=checkpoint)


def preflight(spec_path: SpecArg, overrides: SetOpt = None, as_json: JsonOpt = False):
    """Sanity-check every engine of each core the spec uses, then the collectives between them."""
    spec = load(spec_path, set_overrides(overrides))
    # heavy: prefect and torch
    from trnflow.flows.preflight import STAGES
    from trnflow.flows.preflight import preflight as preflight_flow

    def show(results: dict[str, StageResult]) -> None:
        sanity, collectives = results["sanity"], results["collectives"]
        assert isinstance(sanity, SanityResult) and isinstance(collectives, CollectivesResult)
        console.print(render.sanity_table(sanity.per_core))
        mem = sanity.memory
        if mem:
            console.print(f"device memory per core: {mem.total / 1024**3:.2f} GiB estimated of "
                          f"{mem.per_core_limit / 1024**3:.1f} GiB ({mem.parameters:,} parameters)")
        if collectives.rows:
            print(render.nccom_text(collectives.rows))

    _run_flow(preflight_flow, STAGES, "trnflow preflight", spec, None, as_json, show)


def register(app: typer.Typer) -> None:
    app.command()(reference)
    app.command("compile")(compile_cmd)
    for command in (run, retrain, infer, preflight):
        app.command()(command)
