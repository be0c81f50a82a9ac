"""`trnflow queue`: the runs holding capacity and those waiting for it, in their turn, with each
one's team, class and reason: this machine's NeuronCores, or with `--stack` the stack's instances
that cloud runs share through the Prefect server."""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from trnflow.backends import machine
from trnflow.backends.runqueue import QueueEntry, ordered
from trnflow.cli.common import JsonOpt, console, err
from trnflow.cli.console import RED
from trnflow.errors import ExitCode, TrnflowError
from trnflow.neuron.launch import format_cores

StackOpt = Annotated[bool, typer.Option("--stack", help="The stack's queue of cloud runs, on the Prefect server "
                                        "PREFECT_API_URL names, with what each team and instance type holds.")]


def _stack() -> tuple[list[QueueEntry], dict[str, tuple[int, int]], str]:
    import httpx  # the Prefect client: only the stack's queue needs it
    from prefect.settings import PREFECT_API_URL

    # the stack's queue on the Prefect server: only --stack reads it
    from trnflow.flows._queue import PREFECT_QUEUE

    url = PREFECT_API_URL.value()
    if not url:
        err.print("--stack: the stack's queue is on the Prefect server its orchestrators share; set PREFECT_API_URL "
                  "to it", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    try:
        with PREFECT_QUEUE.deciding():
            found = PREFECT_QUEUE.entries()
        return found, PREFECT_QUEUE.limits(), url
    except (httpx.HTTPError, TrnflowError) as exc:
        err.print(f"--stack: the Prefect server {url} did not answer ({exc})", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None


def queue(as_json: JsonOpt = False, stack: StackOpt = False):
    """List a queue: runs holding capacity, then runs waiting, next first, with why."""
    found, limits, source = _stack() if stack else (machine.entries(), {}, str(machine.queue_dir()))
    runs = ordered(found)
    where = "the stack's queue" if stack else "this machine's queue"
    if as_json:
        listed = [e.model_dump(mode="json") for e in runs]
        print(json.dumps({"runs": listed, "limits": {k: {"held": v[0], "limit": v[1]} for k, v in limits.items()}}
                         if stack else listed, indent=2))
        return
    if not found:
        console.print(f"no run holds or waits in {where}")
    else:
        now = time.time()
        table = Table("run", "team", "class", "state", "holds / place", "for", "reason", title=f"{where} ({source})")
        waiting = [e for e in runs if e.state == "waiting"]
        for e in runs:
            if e.state == "holding":
                held = format_cores(e.cores) if e.cores else f"{e.units} {e.pool}"
                table.add_row(Text(e.label), e.team, e.priority_class, Text("holding", style="green"), held,
                              f"{now - (e.admitted or now):.0f} s", "")
            else:
                table.add_row(Text(e.label), e.team, e.priority_class, Text("waiting", style="yellow"),
                              f"{waiting.index(e) + 1} of {len(waiting)}", f"{now - e.arrived:.0f} s", Text(e.reason))
        console.print(table)
    if limits:
        held = Table("global concurrency limit", "held", "limit", title="what each instance type and team holds")
        for name, (taken, limit) in sorted(limits.items()):
            held.add_row(name, str(taken), str(limit))
        console.print(held)


def register(app: typer.Typer) -> None:
    app.command()(queue)
