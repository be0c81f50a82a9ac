"""`trnflow queue`: the runs holding this machine's NeuronCores and those waiting for them, in their
turn, with each one's team, class and reason."""

from __future__ import annotations

import json
import time

import typer
from rich.table import Table
from rich.text import Text

from trnflow.backends import machine
from trnflow.cli.common import JsonOpt, console
from trnflow.neuron.launch import format_cores


def queue(as_json: JsonOpt = False):
    """List this machine's queue: runs holding NeuronCores, then runs waiting, next first, with why."""
    found = machine.entries()
    holding = sorted((e for e in found if e.state == "holding"), key=lambda e: e.admitted or 0.0)
    waiting = sorted((e for e in found if e.state == "waiting"),
                     key=lambda e: (e.place is None, e.place or 0, -e.priority, e.arrived))
    if as_json:
        print(json.dumps([e.model_dump(mode="json") for e in holding + waiting], indent=2))
        return
    if not found:
        console.print("no run holds or waits for this machine's NeuronCores")
        raise typer.Exit()
    now = time.time()
    table = Table("run", "team", "class", "state", "cores / place", "for", "reason",
                  title=f"this machine's queue ({machine.queue_dir()})")
    for e in holding:
        since = now - (e.admitted or now)
        table.add_row(Text(e.label), e.team, e.priority_class, Text("holding", style="green"),
                      format_cores(e.cores), f"{since:.0f} s", "")
    for n, e in enumerate(waiting):
        table.add_row(Text(e.label), e.team, e.priority_class, Text("waiting", style="yellow"),
                      f"{n + 1} of {len(waiting)}", f"{now - e.arrived:.0f} s", Text(e.reason))
    console.print(table)


def register(app: typer.Typer) -> None:
    app.command()(queue)
