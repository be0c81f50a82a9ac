"""The `trnflow` command: the app that gathers every command group, and the commands that read
specs (`validate`, `schema`) or start the mock cloud (`mock-aws`).

This is the composition root: it reads specs and settings, picks what to run and prints results.
Each command group has a module of its own (`devices`, `data`, `pipeline`, `cache`, `models`,
`serve`, `runs`); prefect is imported only by the commands that run flows, so the others start fast.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from trnflow.cli import devices as cli_devices
from trnflow.cli import pipeline as cli_pipeline
from trnflow.cli import plan as cli_plan
from trnflow.cli import prelaunch
from trnflow.cli import queue as cli_queue
from trnflow.cli import recipes as cli_recipes
from trnflow.cli import runs as cli_runs
from trnflow.cli import serve as cli_serve
from trnflow.cli import teams as cli_teams
from trnflow.cli.cache import cache_app
from trnflow.cli.checkpoints import checkpoint_app
from trnflow.cli.common import JsonOpt, SetOpt, checked, console, err, set_overrides
from trnflow.cli.console import RED
from trnflow.cli.data import data_app
from trnflow.cli.models import models_app
from trnflow.cli.tracking import tracking_app
from trnflow.errors import ExitCode
from trnflow.specs import CATALOGUE, JobSpec, SpecError
from trnflow.teams import NAME as TEAM_NAME

app = typer.Typer(
    name="trnflow",
    help="Production training pipelines for AWS Trainium, with a local NeuronCore emulator.",
    no_args_is_help=True,
    add_completion=False,
)


def _extra_command(name: str) -> Callable[..., Any]:
    """The function an installed package registers as `name` in the `trnflow.commands` group;
    ModuleNotFoundError when it, or what it needs, is not installed."""
    found = [ep for ep in entry_points(group="trnflow.commands") if ep.name == name]
    if not found:
        raise ModuleNotFoundError(f"no package registers the command {name!r}", name="trnflow[mock]")
    return found[0].load()


QuotaOpt = Annotated[list[str] | None, typer.Option(
    "--quota", help="Each declared team's quota of an instance type: --quota trn1.32xlarge=2 (repeatable); their "
    "cloud runs then queue for it on the Prefect server.")]


@app.command("mock-aws")
def mock_aws_command(port: int = typer.Option(5000, help="Port on 127.0.0.1."),
                     seed_data: bool = typer.Option(True, help="Upload the quickstart's synthetic dataset."),
                     provision_seconds: float = typer.Option(
                         0.5, min=0, help="How long a new instance takes to boot (a real trn1 takes minutes)."),
                     image_pull_seconds: float = typer.Option(
                         0.5, min=0, help="How long a new instance takes to pull the training image (a Neuron "
                         "image of more than 10 GB takes minutes)."),
                     teams: str = typer.Option("", help="Declare these teams (comma-separated, e.g. search,ads): each "
                                               "gets folders of its own, a signing key and a role to start runs as "
                                               "(docs/cloud.md, Teams)."),
                     quota: QuotaOpt = None) -> None:
    """Run SageMaker, Batch, S3 and CloudWatch on 127.0.0.1 (moto), with submitted jobs run for real.
    Every instance a job starts is counted and billed from its start, as each service bills: the
    cost table shows both."""
    try:
        mock_aws = _extra_command("mock-aws")  # the mock extra's (moto): test machinery, never imported by name
    except ModuleNotFoundError as exc:
        err.print(f"trnflow mock-aws needs {exc.name}, which comes with the mock extra: "
                  "pip install 'trnflow[mock]' (or 'trnflow[dev]' in a checkout)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    names = [t.strip() for t in teams.split(",") if t.strip()]
    if bad := [t for t in names if not re.fullmatch(TEAM_NAME, t)]:
        err.print(f"--teams: {', '.join(bad)} cannot name a team (lowercase letters, digits and -)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    quotas = {}
    for pair in quota or []:
        kind, _, count = pair.partition("=")
        if kind not in CATALOGUE or not count.isdigit():
            err.print(f"--quota {pair}: give an instance type and a count, e.g. trn1.32xlarge=2", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        quotas[kind] = int(count)
    if quotas and not names:
        err.print("--quota: quotas are the declared teams'; name them with --teams", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    mock_aws(port=port, seed_data=seed_data, provision_seconds=provision_seconds,
             image_pull_seconds=image_pull_seconds, teams=names, quotas=quotas)


@app.command()
def validate(
    specs: Annotated[list[Path], typer.Argument(help="One or more job spec files.")],
    data_check: prelaunch.DataCheckOpt = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Check job specs (with --set overrides applied, as `run` applies them), their data locations and
    the gate's reference; list every problem as `field.path: message`."""
    report, failed = [], False
    changes = set_overrides(overrides)
    for path in specs:
        try:
            spec = checked(path, changes)
        except SpecError as exc:
            failed = True
            report.append({"file": str(path), "valid": False, "problems": exc.problems})
            continue
        problems, notes = prelaunch.report(spec, data_check)
        missing = prelaunch.missing_inputs(spec)
        memory, problem = prelaunch.memory_plan(spec) if not missing else (None, None)
        problems += [problem] if problem else []
        if memory and not problems:  # `trnflow plan` has the whole of it
            notes.append(prelaunch.forecast(spec, memory))
        notes = ([memory.describe()] if memory else []) + notes + [
            f"{line} (a run refuses to start without it; the memory check waits for it)" for line in missing]
        failed = failed or bool(problems)
        report.append({"file": str(path), "valid": not problems, "name": spec.name,
                       **({"memory": memory.as_dict()} if memory else {}),
                       **({"problems": problems} if problems else {}), **({"notes": notes} if notes else {})})
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for item in report:
            if item["valid"]:
                console.print(f"[green]ok[/green] {escape(item['file'])} ({item['name']})")
            else:
                err.print(f"[red]invalid[/red] {escape(item['file'])}")
                for problem in item["problems"]:
                    err.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
            for note in item.get("notes", []):
                (console if item["valid"] else err).print(f"  note: {note}", markup=False, highlight=False,
                                                          style="dim")
    raise typer.Exit(ExitCode.BAD_INPUT if failed else ExitCode.OK)


@app.command()
def schema():
    """Print the JSON Schema of a job spec (for editor completion of YAML specs)."""
    print(json.dumps(JobSpec.model_json_schema(), indent=2))


cli_devices.register(app)  # devices, top, collectives: the emulated NeuronCores
cli_recipes.register(app)  # recipes: the models this trnflow can train
app.add_typer(data_app, name="data")
cli_pipeline.register(app)  # reference, compile, run, retrain, preflight
cli_plan.register(app)  # plan: a run's time and cost, forecast
cli_queue.register(app)  # queue: the runs holding this machine's cores or the stack's instances, and those waiting
cli_teams.register(app)  # teams: the stack's teams, their quotas and their Batch shares
app.add_typer(cache_app, name="cache")
app.add_typer(models_app, name="models")
app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(tracking_app, name="tracking")
cli_serve.register(app)  # deployments of every flow
cli_runs.register(app)  # runs on a Prefect server: submit, runs, status, logs, cancel
