"""`python -m tests.faults [--cases a,b] [--ci] [--json FILE]`: run the fault matrix, print it as a
table, write it as JSON, and exit 1 unless every case recovered with everything equal."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.faults.matrix import CASES, COLUMNS, Matrix, passed, table_rows
from tests.faults.world import world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--ci", action="store_true", help="only the cases `make test` runs")
    parser.add_argument("--json", type=Path, default=Path("runs/faults.json"), help="where to write the report")
    parser.add_argument("--workdir", type=Path, help="work folder (default: a new temporary one)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if not args.ci or c.ci]
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {c.name for c in CASES})
        if unknown:
            parser.error(f"unknown case(s) {', '.join(unknown)}; --list shows them")
        cases = [c for c in CASES if c.name in wanted]
    console = Console(stderr=True)
    if args.list:
        for case in cases:
            print(f"{case.name:28} {case.what}")
        return 0

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="trnflow-faults-"))
    rows = []
    with world(workdir) as w, Matrix(w) as matrix:
        console.print(f"[bold]fault matrix[/bold] in {workdir}: the fault-free run first")
        seconds = matrix.run_baseline()
        console.print(f"  baseline: {seconds:.0f} s")
        for case in cases:
            console.print(f"  {case.name}: {case.what} ...")
            row = matrix.run_case(case)
            rows.append(row)
            console.print(f"    {'ok' if passed(row) else 'FAILED'} ({row.get('seconds', 0)} s)")
    table = Table(title="fault matrix: each case against the fault-free run")
    for column in COLUMNS:
        table.add_column(column)
    for cells in table_rows(rows):
        table.add_row(*cells)
    Console(width=160).print(table)
    for row in rows:
        if not passed(row):
            print(f"{row['case']}: {row.get('error') or row}", file=sys.stderr)
    report = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "all_passed": all(map(passed, rows)), "cases": rows}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(json.dumps({"cases": len(rows), "passed": sum(map(passed, rows)), "report": str(args.json)}))
    return 0 if report["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
