"""What can be checked of a spec before its first job starts, for `trnflow validate` and for the
commands that launch jobs: its data locations (from their listings, without reading a row) and the
gate's reference file. The spec's own checks (fields, cloud locations on S3, the recipe) come first,
in `common.checked`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from trnflow.backends import cache_trust_problem, scope_problem, team_problem
from trnflow.cli.common import err
from trnflow.cli.console import RED
from trnflow.device.plans import cache_problem
from trnflow.errors import DataError, ExitCode, FatalError, FieldError
from trnflow.lifecycle.exports import read_marker
from trnflow.lifecycle.locations import reference_problem
from trnflow.reporting.budget import has_limits, over_limits
from trnflow.reporting.forecast import OVERRIDE_HINT, headline, launch_forecast
from trnflow.reporting.tracking import server_problem
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec
from trnflow.storage import local_path
from trnflow.storage.datafiles import cannot_list, listing_problems, unreachable_errors

if TYPE_CHECKING:  # the plan needs torch; the checks above do not
    from trnflow.workload.memory import MemoryPlan

DATA_FIELDS = ("train", "holdout", "inference")

DataCheckOpt = Annotated[bool | None, typer.Option(
    "--data-check/--no-data-check",
    help="Check that data.train, data.holdout and data.inference exist and hold files in data.format, that "
    "gate.reference is a metrics file, and that tracking.mlflow_uri answers. Default: the local ones, unless none "
    "of the data exists yet; --data-check: every one, s3:// and the tracking server included; --no-data-check: "
    "none.", show_default=False)]


def report(spec: JobSpec, data_check: bool | None) -> tuple[list[str], list[str]]:
    """`trnflow validate`'s check: problems as `FIELD: message`, and notes on what was not checked and why."""
    trusted = [found] if (found := cache_problem(spec)) else []  # not data: checked whatever --data-check says
    if data_check is False:
        return trusted, []
    urls = {f"data.{field}": getattr(spec.data, field) for field in DATA_FIELDS}
    notes = []
    if data_check is None:  # S3 needs credentials and a network call: only when asked for
        remote = [field for field, url in urls.items() if url.startswith("s3://")]
        if remote:
            them = "them" if len(remote) > 1 else "it"
            notes.append(f"{', '.join(remote)}: not checked, on S3; --data-check lists {them}")
        urls = {field: url for field, url in urls.items() if field not in remote}
        if urls and not any(local_path(url).exists() for url in urls.values()):
            notes.append(f"{', '.join(urls)}: not checked, none exists yet (a spec written before its data); "
                         "--data-check requires them")
            urls = {}
    ready = {"data.train": spec.data.ready_marker}
    problems = [f"{field}: {message}" for field, url in urls.items()
                for message in listing_problems(url, spec.data.format, ready.get(field))]
    inputs = remote_inputs(spec)
    if inputs and data_check:
        problems += [f"{field}: {message}" for field, url in inputs.items() if (message := export_problem(url))]
    elif inputs:
        notes.append(f"{', '.join(inputs)}: not checked, on S3; --data-check reads its EXPORTED marker")
    reference = reference_problem(spec, remote=bool(data_check))
    if reference and data_check is None and "does not exist" in reference:
        notes.append(f"{reference} (a run refuses to start without it)")
    elif reference:
        problems.append(reference)
    if spec.tracking.mlflow_uri and data_check:
        problem, note = server_problem(spec.tracking.mlflow_uri)
        problems += [problem] if problem else []
        notes += [note] if note else []
    elif spec.tracking.mlflow_uri:
        notes.append("tracking.mlflow_uri: not asked whether it answers; --data-check asks it")
    return trusted + problems, notes


def remote_inputs(spec: JobSpec) -> dict[str, str]:
    """The recipe's s3:// inputs (a pretrained model's folder on S3), by field."""
    from trnflow.workload.recipes import recipe_for  # a recipe is a model: torch (~1 s)

    try:
        return recipe_for(spec).remote_inputs()
    except FatalError:
        return {}


def export_problem(url: str) -> str | None:
    """Why the folder at `url` cannot be fetched as a pretrained model (no readable EXPORTED marker
    listing its files), or None."""
    try:
        read_marker(url)
    except DataError as exc:
        return str(exc)
    except unreachable_errors() as exc:
        return cannot_list(url, exc)
    return None


def missing_inputs(spec: JobSpec) -> list[str]:
    """The recipe's local inputs (a pretrained model's folder) that do not exist, each as a line."""
    from trnflow.workload.recipes import recipe_for  # a recipe is a model: torch (~1 s)

    try:
        inputs = recipe_for(spec).local_inputs()
    except FatalError:  # a recipe named by module that cannot be imported here: the memory check says so
        return []
    return [f"{field}: {path} does not exist; create it first (for a model trained by trnflow: "
            "`trnflow models export MODEL FOLDER -r REGISTRY`)" for field, path in inputs.items()
            if not Path(path).exists()]


def memory_plan(spec: JobSpec) -> tuple[MemoryPlan | None, str | None]:
    """The device-memory plan (`train.parallelism`: both strategies' per-core figures and the one the
    run takes), or the refusal of a job that fits no core, as a problem line."""
    from trnflow.workload.memory import check_fits  # builds the model on the meta device: torch (~1 s)

    try:
        return check_fits(spec), None
    except FieldError as exc:  # a field other than the layout, such as a recipe that cannot be built here
        return None, str(exc)
    except FatalError as exc:
        return None, f"train.parallelism: {exc}"


def forecast(spec: JobSpec, memory: MemoryPlan) -> str:
    """The one-line forecast of a run of `spec` on the layout `memory` decided
    (`trnflow.reporting.forecast.headline`)."""
    return headline(spec.with_layout(memory.layout), TrnflowSettings().home.expanduser().resolve())


def launch_problems(spec: JobSpec, retraining: bool = False) -> list[str]:
    """What would stop a run that is about to start: its team undecided or the spec reaching outside
    it, its local data missing, empty or unreadable by
    its listing, a compile cache it cannot trust (a folder others can write, a shared one with no
    key to check it), its deployment's settings missing, a folder its jobs' roles cannot name, and
    its gate reference missing, malformed or (for a run judged step by step, not `retraining`)
    sharing no evaluation step with it (s3:// ones are checked by the run itself, before its first
    job)."""
    problems = [f"data.{field}: {message}" for field in DATA_FIELDS
                if (url := getattr(spec.data, field)).startswith("file://")
                for message in listing_problems(url, spec.data.format,
                                                spec.data.ready_marker if field == "train" else None)]
    checks = (team_problem(spec), cache_problem(spec), cache_trust_problem(spec), scope_problem(spec),
              reference_problem(spec, False, retraining))
    return problems + [found for found in checks if found] + missing_inputs(spec)


def refuse_outside_team(spec: JobSpec, source: str, writes_reference: bool = False) -> None:
    """Exit 2 when a command that starts a job of `spec` by itself (`compile`, `reference`, a
    calibration) would start it for no team, or outside its team (`team_problem`;
    `writes_reference`: the command writes gate.reference)."""
    problem = team_problem(spec, writes_reference=writes_reference)
    _refuse(source, [problem] if problem else [])


def refuse_unlaunchable(spec: JobSpec, source: str, retraining: bool = False) -> None:
    """Exit 2 listing every problem `launch_problems` finds, before any job starts."""
    _refuse(source, launch_problems(spec, retraining))


def _refuse(source: str, problems: list[str]) -> None:
    """Exit 2 listing `problems`, a line each, when there are any."""
    if problems:
        err.print(f"{source}: cannot start", **RED)
        for problem in problems:
            err.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.BAD_INPUT)


OverrideOpt = Annotated[str | None, typer.Option(
    "--override-forecast", metavar="REASON",
    help="Launch even though the run is forecast to miss train.max_minutes or a budget (compute.max_cost_usd, "
    "train.max_cost_usd), which is otherwise refused (exit 2); REASON is said in the run's log and summary. The "
    "budget still stops training while it runs.")]


def refuse_over_forecast(spec: JobSpec, source: str, override: str | None) -> None:
    """Exit 2 when the run's forecast (`trnflow plan`'s) misses its deadline or budget, naming each
    limit, the forecast and where it comes from, unless `override` says why to go on."""
    if override is not None and not override.strip():
        err.print("--override-forecast needs a reason: the run's log and summary record it", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    if override or not has_limits(spec):
        return
    from trnflow.workload.memory import decided  # the layout the run will take: the recipe's model, torch

    forecast, line = launch_forecast(decided(spec), TrnflowSettings().home.expanduser().resolve())
    problems = over_limits(spec, forecast)
    if problems:
        err.print(f"{source}: refused before its first job ({line})", **RED)
        for problem in problems:
            err.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
        err.print(f"  {OVERRIDE_HINT}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.BAD_INPUT)
