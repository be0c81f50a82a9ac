"""The Neuron SDK's own tools on a real host: `neuron-ls --json-output` for the device inventory,
`nccom-test` for the collectives sweep and `neuron_parallel_compile` for the xla device's trial run,
run when they are on PATH and read in their real formats.

Without them (on any machine but a Neuron host) the sanity, collectives and compile phases use
trnflow's own checks and compiler; each result says which source it used. Torch-free.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, ValidationError
from pydantic.fields import FieldInfo

from trnflow.errors import FatalError
from trnflow.measures import NCCOM_TIME_COLUMNS, CoreHolder, HostInventory, ParallelCompile, SweepRow

NEURON_LS, NCCOM_TEST, PARALLEL_COMPILE = "neuron-ls", "nccom-test", "neuron_parallel_compile"
NCCOM_OPS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
             "all_to_all": "alltoall"}
"""trnflow's op names -> nccom-test's positional operation."""
REQUIRED = ("neuron_device", "nc_count", "neuroncore_ids")


def which(tool: str) -> str | None:
    """The tool's path when it is on PATH."""
    return shutil.which(tool)


def numa_node(value: Any) -> int | None:
    """A record's `numa_node` as a number: neuron-ls writes it as a string ("1"), and a host
    without NUMA information as -1 or nothing readable (None)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def parse_neuron_ls(text: str, source: str = NEURON_LS) -> list[dict[str, Any]]:
    """The device records of `neuron-ls --json-output`: one object per Neuron device, each with at
    least its index, core count and core ids (its BDF, CPU affinity, NUMA node, memory size and the
    processes holding it when the tool prints them). `cpu_affinity` stays the tool's CPU list
    ("48-95,144-191"); `numa_node`, a string in the tool's output, is read as a number."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FatalError(f"{source}: its output is not JSON ({exc}); is this neuron-ls --json-output?") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise FatalError(f"{source}: expected a list of device objects, got {type(records).__name__}")
    for record in records:
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise FatalError(f"{source}: device {record.get('neuron_device', '?')} has no {', '.join(missing)}; "
                             "a neuron-ls this version of trnflow does not know")
        if "numa_node" in record:
            record["numa_node"] = numa_node(record["numa_node"])
    return records


def neuron_ls(timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run `neuron-ls --json-output` and read its device records."""
    done = subprocess.run([NEURON_LS, "--json-output"], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise FatalError(f"{NEURON_LS} --json-output failed (exit {done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-500:]}")
    return parse_neuron_ls(done.stdout)


def inventory(records: list[dict[str, Any]], cores: list[int], own_pids: set[int], source: str = NEURON_LS
              ) -> HostInventory:
    """What the host's device list says about the job's `cores`: the devices and cores it lists,
    the job's cores it does not list, and those another process holds."""
    listed = {core for r in records for core in r["neuroncore_ids"]}
    held = {}
    for record in records:
        for proc in record.get("neuron_processes") or []:
            if proc.get("pid") in own_pids:
                continue
            for core in proc.get("neuroncore_ids") or record["neuroncore_ids"]:
                if core in cores:
                    held[core] = CoreHolder(pid=proc.get("pid"), command=str(proc.get("command", "?")))
    return HostInventory(source=source, devices=len(records), cores=sum(int(r["nc_count"]) for r in records),
                         missing=sorted(set(cores) - listed), held=dict(sorted(held.items())))


def nccom_command(op: str, ranks: int, minbytes: int, maxbytes: int, stepfactor: int, dtype: str, iters: int,
                  warmup: int, check: bool, report: Path) -> list[str]:
    """nccom-test's command line for one op's sweep on this host's `ranks` cores."""
    argv = [NCCOM_TEST, NCCOM_OPS[op], "-r", str(ranks), "-b", str(minbytes), "-e", str(maxbytes),
            "-f", str(stepfactor), "-d", dtype, "-n", str(iters), "-w", str(warmup), "--non-interactive",
            "--report-to-json-file", str(report)]
    return [*argv, "-c", "all_ones"] if check else argv


def parse_nccom_json(text: str, op: str, source: str = NCCOM_TEST) -> list[SweepRow]:
    """nccom-test's JSON report as trnflow's sweep rows, whichever spelling of the time column the
    tool's version wrote (`SweepRow`), so the tables and reports that read the rows need not know it."""
    try:
        results = json.loads(text)["results"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise FatalError(f"{source}: not an nccom-test JSON report ({exc})") from None
    known = {name for key, field in SweepRow.model_fields.items() for name in (key, *_aliases(field))}
    rows = []
    for r in results:
        given = {k: v for k, v in r.items() if k in known and v is not None}  # a null time is no time
        if "size(B)" not in given:
            raise FatalError(f"{source}: a result with no size(B): {r}")
        if not any(c in given for c in NCCOM_TIME_COLUMNS):
            raise FatalError(f"{source}: a result with no time column (neither {' nor '.join(NCCOM_TIME_COLUMNS)}): "
                             f"{r}")
        try:
            rows.append(SweepRow.model_validate({**given, "op": op}))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise FatalError(f"{source}: a result trnflow cannot read ({problems}): {r}") from None
    return rows


def _aliases(field: FieldInfo) -> list[str]:
    """The other names a field is read under: its alias and each of its validation aliases."""
    choices = field.validation_alias.choices if isinstance(field.validation_alias, AliasChoices) else []
    return [n for n in (field.alias, *choices) if isinstance(n, str)]


def nccom_sweep(op: str, ranks: int, minbytes: int, maxbytes: int, stepfactor: int, dtype: str, iters: int,
                warmup: int, check: bool, timeout: float = 1800.0) -> list[SweepRow]:
    """Run nccom-test for one op and read its rows; `correct` is False on every row when it reports
    errors (with --check, a wrong result fails the run)."""
    with tempfile.TemporaryDirectory(prefix="trnflow-nccom-") as tmp:
        report = Path(tmp) / "report.json"
        argv = nccom_command(op, ranks, minbytes, maxbytes, stepfactor, dtype, iters, warmup, check, report)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
        if not report.exists():
            raise FatalError(f"{' '.join(argv)} failed (exit {done.returncode}) and wrote no report: "
                             f"{(done.stderr or done.stdout).strip()[-500:]}")
        rows = parse_nccom_json(report.read_text(), op)
    for row in rows:
        row.correct = done.returncode == 0 if check else None
    return rows


def parallel_compile_command(tool: str, workers: int, command: list[str]) -> list[str]:
    """`neuron_parallel_compile --num_parallel N <command>`: runs `command` as a trial in graph
    extraction mode (NEURON_EXTRACT_GRAPHS_ONLY), then compiles the graphs N at a time into the
    persistent cache that NEURON_CC_FLAGS' --cache_dir names."""
    return [tool, "--num_parallel", str(workers), *command]


TOTALS = {"graphs": "Total graphs", "compiled": "Total successful compilations",
          "failed": "Total failed compilations"}


def parse_parallel_compile(text: str) -> dict[str, int]:
    """The totals neuron_parallel_compile prints as it finishes (`INFO ||NEURON_PARALLEL_COMPILE||:
    Total graphs: 2`, ...); a total it did not print is left out."""
    found = {}
    for name, label in TOTALS.items():
        hits = re.findall(rf"\|\|NEURON_PARALLEL_COMPILE\|\|: {label}: (\d+)", text)
        if hits:
            found[name] = int(hits[-1])
    return found


def parallel_compile(workers: int, command: list[str], env: dict[str, str], timeout: float = 6 * 3600.0
                     ) -> ParallelCompile:
    """Run `command` under neuron_parallel_compile; its totals, or an error with the end of its
    output when it fails or reports a failed compilation (a compiler error: never retried)."""
    tool = which(PARALLEL_COMPILE)
    assert tool is not None, "parallel_compile runs only where neuron_parallel_compile is on PATH"
    argv = parallel_compile_command(tool, workers, command)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    output = done.stdout + done.stderr
    totals = parse_parallel_compile(output)
    if done.returncode != 0 or totals.get("failed"):
        raise FatalError(f"{PARALLEL_COMPILE} failed (exit {done.returncode}, "
                         f"{totals.get('failed', 'an unknown number of')} failed compilations): "
                         f"{output.strip()[-1500:]}")
    return ParallelCompile(tool=PARALLEL_COMPILE, workers=workers, **totals)
