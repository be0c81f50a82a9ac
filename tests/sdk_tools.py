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
