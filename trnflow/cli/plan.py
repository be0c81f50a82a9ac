"""`trnflow plan`: how long a run of a spec will take and what it will cost, before it starts
(`trnflow.reporting.forecast`)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trnflow.cli.common import JsonOpt, SetOpt, console, err, load, set_overrides
from trnflow.reporting.forecast import history, minutes, plan
from trnflow.settings import TrnflowSettings


def plan_command(spec: Annotated[Path, typer.Argument(help="The job spec.")], overrides: SetOpt = None,
                 as_json: JsonOpt = False) -> None:
    """Forecast a pipeline run of SPEC: per stage, its instances, time (with a range) and cost, and
    where each figure comes from (earlier runs of the model on this layout, scaled from another
    layout, or a stated guess); then the total and when it would end if started now."""
    from trnflow.workload.memory import decided  # the memory planner needs the recipe's model: torch

    job = decided(load(spec, set_overrides(overrides)))
    records, unread = history(job, TrnflowSettings().home.expanduser().resolve())
    forecast = plan(job, records)
    notes = forecast.notes + [f"left out of the history (unreadable): {line}" for line in unread]
    if as_json:
        print(forecast.model_copy(update={"notes": notes}).model_dump_json(indent=2))
        return
    table = Table(title=f"{job.name}: {forecast.layout.describe()}", title_justify="left")
    for column in ("stage", "nodes", "time", "range", "cost ($)", "from"):
        table.add_column(column, justify="right" if column in ("nodes", "time", "cost ($)") else "left")
    for row in forecast.stages:
        cost = "-" if row.cost_usd is None else f"{row.cost_usd:.4f}"
        table.add_row(row.stage, str(row.nodes), minutes(row.seconds), f"{minutes(row.low)}-{minutes(row.high)}",
                      cost, f"{row.source}: {row.basis}")
    console.print(table)
    ends = dt.datetime.fromtimestamp(forecast.finish_at).astimezone().strftime("%Y-%m-%d %H:%M %Z")
    console.print(f"{forecast.headline()}; started now, it ends about {ends}", highlight=False)
    for note in notes:
        err.print(f"note: {note}", style="dim", markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
