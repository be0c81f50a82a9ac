"""Rich tables and nccom-test-style text for what the CLI prints."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from trnflow.reporting.report import ENGINES, cost_cells, engine_outcomes, with_not_run
from trnflow.results import Cost, StageRow

STATE_COLOURS = {"Completed": "green", "Skipped": "cyan", "Failed": "red", "NotRun": "dim"}

PIPED_WIDTH = 200
"""How wide printed output may be when it goes to a file or pipe rather than a terminal."""

RED = {"style": "red", "markup": False, "highlight": False}
"""`console.print(text, **RED)`: an error line in red, its text printed as it is (never as markup)."""


def cli_console(stderr: bool = False) -> Console:
    """The CLI's console. On a terminal it is as wide as the terminal; piped or redirected, Rich
    would cut tables at 80 columns, so it is PIPED_WIDTH wide unless COLUMNS says otherwise."""
    out = Console(stderr=stderr)
    if out.is_terminal or "COLUMNS" in os.environ:
        return out
    return Console(stderr=stderr, width=PIPED_WIDTH)


def stage_table(rows: list[StageRow], stages: tuple[str, ...] = (), title: str | None = None) -> Table:
    """One row per stage: state, duration, the device its job ran on, key figure; stages that never
    ran show NotRun. The key figure is printed as it is (an error message is never read as markup)."""
    table = Table("stage", "state", "duration", "device", "key figure", title=title)
    for r in with_not_run(rows, stages):
        duration = "" if r.seconds is None else f"{r.seconds:.1f}s"
        table.add_row(r.stage, Text(r.state, style=STATE_COLOURS.get(r.state, "yellow")), duration, r.device,
                      Text(r.summary))
    return table


def sanity_table(per_core: list[dict[str, Any]]) -> Table:
    """One row per core, one column per engine: pass, or the tests that failed."""
    table = Table("core", *ENGINES, title="known-answer tests per engine")
    for core in per_core:
        cells = ("[red]FAIL " + ", ".join(failed) + "[/red]" if failed else f"[green]ok[/green] ({ran})"
                 for ran, failed in engine_outcomes(core))
        table.add_row(f"nc{core['core']}", *cells)
    return table


def nccom_text(rows: list[dict[str, Any]]) -> str:
    """The sweep as nccom-test prints it, one block per op, then the average bus bandwidth."""
    lines: list[str] = []
    for op in dict.fromkeys(r["op"] for r in rows):
        lines.append(f"# {op}")
        lines.append(f"{'size(B)':>12}{'count(elems)':>16}{'type':>9}{'time(us)':>12}{'algbw(GB/s)':>15}"
                     f"{'busbw(GB/s)':>15}{'check':>8}")
        for r in (r for r in rows if r["op"] == op):
            check = {True: "ok", False: "WRONG", None: "-"}[r.get("correct")]
            lines.append(f"{r['size(B)']:>12}{r['count(elems)']:>16}{r['type']:>9}{r['time(us)']:>12.1f}"
                         f"{r['algbw(GB/s)']:>15.4f}{r['busbw(GB/s)']:>15.4f}{check:>8}")
    if rows:
        avg = sum(r["busbw(GB/s)"] for r in rows) / len(rows)
        lines.append(f"Avg bus bandwidth:\t{avg:.4f}GB/s")
    return "\n".join(lines)


def parse_size(text: str) -> int:
    """`64KB`, `1MB`, `1GB` or a byte count (binary units, as nccom-test reads them)."""
    units = {"GB": 1024**3, "MB": 1024**2, "KB": 1024, "G": 1024**3, "M": 1024**2, "K": 1024, "B": 1}
    value = text.strip().upper()
    for unit, factor in units.items():
        if value.endswith(unit) and value[: -len(unit)].strip().isdigit():
            return int(value[: -len(unit)]) * factor
    if value.isdigit():
        return int(value)
    raise ValueError(f"{text!r} is not a size; write for example 65536, 64KB or 1MB")


def top_table(itype: str, rows: list[dict[str, Any]]) -> Table:
    """The `trnflow top` view: a row per core with a utilisation bar."""
    table = Table("core", "device", "utilization", "memory held", "pid", "command",
                  title=f"{itype} NeuronCores (emulated)")
    for r in rows:
        filled = int(r["utilization"] / 10)
        bar = "[green]" + "█" * filled + "[/green]" + "·" * (10 - filled)
        memory = f"{r['memory_bytes'] / 1024**2:,.0f} MiB" if r["pid"] else "-"
        table.add_row(f"nc{r['core']}", str(r["device"]), f"{bar} {r['utilization']:5.1f}%", memory,
                      str(r["pid"] or "-"), r["command"] or "[dim]free[/dim]")
    return table


def cost_table(cost: Cost) -> Table:
    """Each job's instances, price, billable time and cost, and the run's total."""
    table = Table("stage", "instance type", "nodes", "jobs", "price ($/node-hour)", "billable time (s)", "cost ($)",
                  title="what the jobs cost (on-demand prices; failed jobs included)")
    rows, total = cost_cells(cost)
    for row in rows:
        table.add_row(*row)
    table.add_row("[bold]total[/bold]", "", "", "", "", "", f"[bold]{total}[/bold]")
    return table
