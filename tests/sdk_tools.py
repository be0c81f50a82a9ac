"""Executables that print what the Neuron SDK's tools print, for tests of the code that runs them
from PATH (no Neuron host is reachable from the tests)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

NCCOM_TEST = """
args = sys.argv[1:]
report = args[args.index("--report-to-json-file") + 1]
ranks, op = int(args[args.index("-r") + 1]), args[0]
rows = [{"size(B)": 65536, "count(elems)": 16384, "type": "fp32", "algbw(GB/s)": 1.0,
         "busbw(GB/s)": round(2 * (ranks - 1) / ranks, 4), "time:avg(us)": 61.0}]
json.dump({"results": rows}, open(report, "w"))
sys.exit(1 if "-c" in args and op == "alltoall" else 0)  # errors found: a check that fails
"""


def fake_tool(folder: Path, name: str, body: str) -> Path:
    """An executable `name` in `folder` that runs `body` (Python, with json and sys imported)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport json, sys\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def fake_neuron_ls(folder: Path, devices: list[dict]) -> Path:
    return fake_tool(folder, "neuron-ls", f"assert sys.argv[1:] == ['--json-output']\nprint({json.dumps(devices)!r})")


PARALLEL_COMPILE = """
import os, pathlib, subprocess
args = sys.argv[1:]
assert args[0] == "--num_parallel", args
workers, command = int(args[1]), args[2:]
# the extraction pass (None: not run)
code = subprocess.run(command, env={{**os.environ, "NEURON_EXTRACT_GRAPHS_ONLY": "1"}}).returncode if {trial} else None
output = pathlib.Path(command[command.index("--output") + 1])
pathlib.Path({record!r}).write_text(json.dumps({{
    "workers": workers, "command": command, "trial_exit": code,
    "neuron_cc_flags": os.environ.get("NEURON_CC_FLAGS", ""),
    "trial_result": json.loads((output / "result.json").read_text()) if code == 0 else None}}))
graphs, failed = 3, {failed}
print("INFO ||NEURON_PARALLEL_COMPILE||: master grab hlos to compile: [...]")
print("INFO ||NEURON_PARALLEL_COMPILE||: Total graphs: %d" % graphs)
print("INFO ||NEURON_PARALLEL_COMPILE||: Total successful compilations: %d" % (graphs - failed))
print("INFO ||NEURON_PARALLEL_COMPILE||: Total failed compilations: %d" % failed)
if failed:
    print("ERROR ||PARALLEL_COMPILE||: parallel compilation with neuronx-cc exited with error.Received error code: 1")
sys.exit(code or (1 if failed else 0))
"""


def fake_parallel_compile(folder: Path, record: Path, failed: int = 0, trial: bool = True) -> Path:
    """neuron_parallel_compile: runs the trial command it wraps with NEURON_EXTRACT_GRAPHS_ONLY=1
    (unless `trial` is false, for a test of what follows it only), writes what it was given and what
    the trial reported to `record`, and prints the real tool's closing totals (three graphs, `failed`
    of them failed)."""
    body = PARALLEL_COMPILE.format(record=str(record), failed=failed, trial=trial)
    return fake_tool(folder, "neuron_parallel_compile", body)
