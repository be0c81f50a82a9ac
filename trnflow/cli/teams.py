"""`trnflow teams`: the stack's teams as this machine reads them (`list`), and the Batch fair-share
policy they call for (`shares`, `--apply` to give it to the stack's queue)."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from botocore.exceptions import BotoCoreError, ClientError
from rich.table import Table

from trnflow.backends import fair_share
from trnflow.backends.cloud import published_settings, stack_teams
from trnflow.cli.common import JsonOpt, console, err
from trnflow.cli.console import RED
from trnflow.errors import ExitCode, FatalError
from trnflow.settings import TrnflowSettings
from trnflow.teams import Teams

teams_app = typer.Typer(help="The stack's teams: their quotas, weights and classes, and their Batch shares.",
                        no_args_is_help=True)
ApplyOpt = Annotated[bool, typer.Option("--apply", help="Update the Batch queue's scheduling policy to them.")]


def _teams() -> Teams:
    try:
        found = stack_teams(TrnflowSettings())
    except FatalError as exc:
        err.print(str(exc), **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    if found is None:
        err.print("no teams are declared: set TRNFLOW_TEAMS to the teams file, or deploy the stack with one "
                  "(docs/cloud.md, Teams)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    return found


@teams_app.command("list")
def list_teams(as_json: JsonOpt = False):
    """Each team: its classes, its quota per instance type, its weight, whether it borrows and lends, its share."""
    teams = _teams()
    if as_json:
        print(json.dumps(teams.model_dump(mode="json"), indent=2))
        return
    table = Table("team", "classes", "quotas", "weight", "borrows", "lends", "Batch share",
                  title=f"{len(teams.teams)} teams" + (f", local team {teams.local_team}" if teams.local_team else ""))
    for t in teams.teams:
        quotas = ", ".join(f"{k}: {v}" for k, v in t.quotas.items()) or "none (the capacity only)"
        table.add_row(t.name, ", ".join(c.name for c in t.classes), quotas, f"{t.weight:g}",
                      "yes" if t.borrow else "no", "yes" if t.lend else "no", t.share_identifier or "the spec's")
    console.print(table)
    if teams.capacity:
        console.print("capacity: " + ", ".join(f"{k}: {v} instances" for k, v in teams.capacity.items()))


@teams_app.command()
def shares(apply: ApplyOpt = False, as_json: JsonOpt = False):
    """The Batch fair-share policy the teams call for (each team's share at its weight), beside the one the
    stack's job queue has; --apply gives it to the queue's scheduling policy."""
    teams, settings = _teams(), TrnflowSettings()
    queue = settings.batch_job_queue or published_settings(settings.parameters_path).get("batch_job_queue")
    if not queue:
        err.print("no Batch job queue: set TRNFLOW_BATCH_JOB_QUEUE (the stack's BatchJobQueue output)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    try:
        arn = fair_share.policy_of(queue)
        now, rest = fair_share.current(arn)
        wanted = fair_share.wanted(teams, now)
        same = [(s.identifier, s.weight_factor) for s in wanted] == [(s.identifier, s.weight_factor) for s in now]
        if apply and not same:
            fair_share.apply(arn, wanted, rest)
    except FatalError as exc:
        err.print(str(exc), **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except (BotoCoreError, ClientError) as exc:
        err.print(f"Batch refused: {exc}; the operators' role needs batch:DescribeJobQueues, "
                  "batch:DescribeSchedulingPolicies and batch:UpdateSchedulingPolicy", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    unshared = [t.name for t in teams.teams if not t.share_identifier]
    if as_json:
        print(json.dumps({"policy": arn, "current": [s.model_dump() for s in now],
                          "wanted": [s.model_dump() for s in wanted], "applied": apply and not same,
                          "teams_without_share": unshared}, indent=2))
        return
    table = Table("share", "team", "weight factor now", "from the teams", title=f"scheduling policy {arn}")
    before = {s.identifier: s.weight_factor for s in now}
    for s in wanted:
        table.add_row(s.identifier, s.team or "", f"{before[s.identifier]:g}" if s.identifier in before else "-",
                      f"{s.weight_factor:g}")
    console.print(table)
    if unshared:
        console.print(f"teams without a share identifier (their jobs take the spec's): {', '.join(unshared)}")
    if same:
        console.print("the policy already has these shares")
    elif apply:
        console.print("updated the policy: Batch orders the queue's jobs by these shares from now on")
    else:
        console.print("run with --apply to update the policy (a stack update puts back the template's shares: "
                      "apply again after one)")


def register(app: typer.Typer) -> None:
    app.add_typer(teams_app, name="teams")
