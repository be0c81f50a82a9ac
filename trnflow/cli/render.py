"""Rich tables and nccom-test-style text for what the CLI prints."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from trnflow.cli.console import shown
from trnflow.measures import CoreChecks, SweepRow
from trnflow.reporting.report import (
    ENGINES,
    cost_cells,
    cost_columns,
    engine_outcomes,
    spot_note,
    total_cells,
    with_not_run,
)
from trnflow.results import Cost, StageRow

STATE_COLOURS = {"Completed": "green", "Skipped": "cyan", "Failed": "red", "NotRun": "dim", "Waited": "cyan"}


def stage_table(rows: list[StageRow], stages: tuple[str, ...] = (), title: str | None = None) -> Table:
    """One row per stage: state, duration, the device its job ran on, key figure; stages that never
    ran show NotRun. The key figure is printed as it is (an error message is never read as markup)."""
    table = Table("stage", "state", "duration", "device", "key figure", title=title)
    for r in with_not_run(rows, stages):
        duration = "" if r.seconds is None else f"{r.seconds:.1f}s"
        table.add_row(r.stage, Text(r.state, style=STATE_COLOURS.get(r.state, "yellow")), duration, r.device,
                      Text(r.summary))
    return table


def sanity_table(per_core: list[CoreChecks]) -> Table:
    """One row per core, one column per engine: pass, or the tests that failed."""
    table = Table("core", *ENGINES, title="known-answer tests per engine")
    for core in per_core:
        cells = ("[red]FAIL " + ", ".join(failed) + "[/red]" if failed else f"[green]ok[/green] ({ran})"
                 for ran, failed in engine_outcomes(core))
        table.add_row(f"nc{core.core}", *cells)
    return table


def nccom_text(rows: list[SweepRow]) -> str:
    """The sweep as nccom-test prints it, one block per op, then the average bus bandwidth."""
    lines: list[str] = []
    for op in dict.fromkeys(r.op for r in rows):
        lines.append(f"# {op}")
        lines.append(f"{'size(B)':>12}{'count(elems)':>16}{'type':>9}{'time:avg(us)':>16}{'algbw(GB/s)':>15}"
                     f"{'busbw(GB/s)':>15}{'check':>8}")
        for r in (r for r in rows if r.op == op):
            lines.append(f"{r.size:>12}{r.count:>16}{r.type:>9}{r.time_us:>16.1f}{r.algbw:>15.4f}{r.busbw:>15.4f}"
                         f"{r.verdict:>8}")
    if rows:
        avg = sum(r.busbw for r in rows) / len(rows)
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


NEURON_LS_COLUMNS = ("NEURON DEVICE", "NEURON CORES", "NEURON CORE IDS", "NEURON MEMORY", "CONNECTED DEVICES",
                     "PCI BDF", "CPU AFFINITY", "NUMA NODE")
"""neuron-ls's table columns, in its order; `trnflow devices` adds PID and COMMAND, as `neuron-ls -w` does."""


def core_ids(ids: list[int]) -> str:
    """A device's core ids as neuron-ls prints them: `0-3`, or one id."""
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0]) if ids else ""


def neuron_ls_header(itype: str, instance_id: str, records: list[dict[str, Any]]) -> list[str]:
    """The lines neuron-ls prints above its table: the instance type and id, and on trn2 the
    logical NeuronCore config."""
    lines = [f"instance-type: {itype}", f"instance-id: {instance_id}"]
    lnc = sorted({r["logical_neuroncore_config"] for r in records if "logical_neuroncore_config" in r})
    if lnc:
        lines.append(f"logical-neuroncore-config: {lnc[0]}")
    return lines


def neuron_ls_table(records: list[dict[str, Any]]) -> Table:
    """One row per device in neuron-ls's columns (`NEURON_LS_COLUMNS`), then the processes holding it.
    A narrow terminal wraps a cell rather than cut it: a CPU list cut short would name other CPUs."""
    table = Table(caption="emulated by trnflow")
    for column in (*NEURON_LS_COLUMNS, "PID", "COMMAND"):
        table.add_column(column, overflow="fold")
    for r in records:
        procs = r.get("neuron_processes") or []
        table.add_row(str(r["neuron_device"]), str(r["nc_count"]), core_ids(r["neuroncore_ids"]),
                      f"{r['memory_size'] // 1024**3} GB" if "memory_size" in r else "",
                      ", ".join(map(str, r.get("connected_to", []))), r.get("bdf", ""),
                      str(r.get("cpu_affinity", "")), str(r.get("numa_node", "")),
                      "\n".join(str(p["pid"]) for p in procs), Text("\n".join(p["command"] for p in procs)))
    return table


def top_table(itype: str, rows: list[dict[str, Any]]) -> Table:
    """The `trnflow top` view: a row per core with a utilisation bar."""
    table = Table("core", "device", "utilization", "memory held", "pid", "command",
                  title=f"{itype} NeuronCores (emulated)")
    for r in rows:
        filled = int(r["utilization"] / 10)
        bar = "[green]" + "█" * filled + "[/green]" + "·" * (10 - filled)
        memory = f"{r['memory_bytes'] / 1024**2:,.0f} MiB" if r["pid"] else "-"
        table.add_row(f"nc{r['core']}", str(r["device"]), f"{bar} {r['utilization']:5.1f}%", memory,
                      str(r["pid"] or "-"), shown(r["command"]) if r["command"] else "[dim]free[/dim]")
    return table


def cost_table(cost: Cost) -> Table:
    """Each job's instances, price and where the price comes from (service, region, the day it was
    read), billable time and cost, and the run's total."""
    table = Table(*cost_columns(cost), title="what the jobs cost (on-demand prices; failed jobs included)")
    rows, total = cost_cells(cost)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    columns = cost_columns(cost)[1:]  # after the label's
    table.add_row(Text("total", style="bold"), *(Text(c, style="bold" if name == "cost ($)" else "")
                                                 for name, c in zip(columns, total_cells(cost, total), strict=True)))
    notes = [n for n in (spot_note(cost), f"goodput {cost.goodput}" if cost.goodput else None) if n]
    if notes:
        table.caption = "\n".join(notes)
    return table
