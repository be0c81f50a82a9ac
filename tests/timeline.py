"""Where the suite's time goes: a pytest plugin that writes each test's worker, start and duration,
and a summary of a whole `make test` (or CI) run.

The plugin (`-p tests.timeline --timeline FILE`) runs in the process that reports (xdist's
controller, or the one process without xdist) and writes, at the session's end, one JSON line
for the session (`{"lane", "started", "ended"}`) and one per test (`{"test", "worker", "start",
"duration", "outcome"}`; the duration is setup, call and teardown together). `make` and `.ci/run`
mark each phase's start and end in `phases.jsonl` beside them (`python -m tests.timeline mark`).

    python -m tests.timeline summary runs/test-timeline            # phases and the 20 slowest tests
    python -m tests.timeline summary runs/test-timeline --limit-minutes 50   # and fail past 50 minutes

The summary is plain text, made for a CI log and for docs/testing.md. Standard library only: it
runs with any Python, before any environment exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PHASES = "phases.jsonl"
"""The phases' marks, in the timeline folder."""


@dataclass
class Entry:
    """One test's time: its worker, when its setup started and how long it took in all."""

    test: str
    worker: str
    start: float
    duration: float
    outcome: str


def pytest_addoption(parser):
    parser.addoption("--timeline", default=None, metavar="FILE",
                     help="Write each test's worker, start and duration to FILE (JSON lines).")
    parser.addoption("--timeline-lane", default=None, metavar="NAME",
                     help="The name this session's timeline goes by in the summary (default: the file's stem).")


def pytest_configure(config):
    path = config.getoption("--timeline", None)
    if path and not hasattr(config, "workerinput"):  # xdist's workers report to the controller, which writes
        lane = config.getoption("--timeline-lane") or Path(path).stem
        config.pluginmanager.register(Recorder(Path(path), lane), "trnflow-timeline")


class Recorder:
    def __init__(self, path: Path, lane: str):
        self.path, self.lane, self.started = path, lane, time.time()
        self.entries: dict[str, Entry] = {}

    def pytest_runtest_logreport(self, report):
        node = getattr(report, "node", None)  # xdist's worker controller, on the controller's reports
        worker = node.gateway.id if node is not None else "main"
        entry = self.entries.get(report.nodeid)
        if entry is None:
            entry = self.entries[report.nodeid] = Entry(report.nodeid, worker, report.start, 0.0, "passed")
        entry.start = min(entry.start, report.start)
        entry.duration += report.duration
        if report.failed:
            entry.outcome = "failed"
        elif report.skipped and entry.outcome == "passed":
            entry.outcome = "skipped"

    def pytest_sessionfinish(self):
        lines = [json.dumps({"lane": self.lane, "started": self.started, "ended": time.time()})]
        lines += [json.dumps(vars(e)) for e in sorted(self.entries.values(), key=lambda e: e.start)]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text("\n".join(lines) + "\n")
        partial.replace(self.path)


@dataclass
class Lane:
    name: str
    started: float
    ended: float
    tests: list[Entry]


def read_lanes(folder: Path) -> list[Lane]:
    lanes = []
    for path in sorted(folder.glob("*.jsonl")):
        if path.name == PHASES:
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows and "lane" in rows[0]:
            lanes.append(Lane(rows[0]["lane"], rows[0]["started"], rows[0]["ended"], [Entry(**r) for r in rows[1:]]))
    return sorted(lanes, key=lambda lane: lane.started)


def read_phases(folder: Path) -> list[tuple[str, float, float | None]]:
    """Each phase's name, start and end (None while it runs or when it failed), in order of start."""
    path = folder / PHASES
    if not path.is_file():
        return []
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            mark = json.loads(line)
            (starts if mark["event"] == "start" else ends)[mark["phase"]] = mark["at"]
    return sorted(((name, at, ends.get(name)) for name, at in starts.items()), key=lambda phase: phase[1])


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}:{int(seconds % 60):02d}"


def summary(folder: Path, slowest: int = 20) -> tuple[str, list[Entry]]:
    """The summary's text and the slowest tests, slowest first."""
    phases, lanes = read_phases(folder), read_lanes(folder)
    out = ["Wall time per phase (m:ss):"]
    for name, start, end in phases:
        out.append(f"  {name:<12} {minutes(end - start) if end else 'unfinished':>8}")
    for lane in lanes:
        passed = sum(e.outcome == "passed" for e in lane.tests)
        workers = len({e.worker for e in lane.tests})
        out.append(f"  pytest {lane.name:<12} {minutes(lane.ended - lane.started):>8}  {len(lane.tests)} tests "
                   f"({passed} passed) on {workers} worker{'s' if workers != 1 else ''}")
    for lane in lanes:
        out += _by_file(lane)
    tests = sorted((e for lane in lanes for e in lane.tests), key=lambda e: e.duration, reverse=True)[:slowest]
    if tests:
        out.append(f"The {len(tests)} slowest tests (duration, worker, start after its lane's):")
        firsts = {lane.name: lane.started for lane in lanes}
        lane_of = {e.test: lane.name for lane in lanes for e in lane.tests}
        for e in tests:
            offset = e.start - firsts[lane_of[e.test]]
            out.append(f"  {e.duration:7.1f} s  {e.worker:<4} +{minutes(offset):>6}  {e.test}")
    return "\n".join(out), tests


def _by_file(lane: Lane, longest: int = 10) -> list[str]:
    """How busy each of a lane's workers was, and its longest files (their tests' durations summed):
    what the distribution balances, and where the lane's time goes. Nothing for a lane of one file."""
    files: dict[str, float] = {}
    workers: dict[str, float] = {}
    for e in lane.tests:
        name = e.test.split("::")[0]
        files[name] = files.get(name, 0.0) + e.duration
        workers[e.worker] = workers.get(e.worker, 0.0) + e.duration
    if len(files) < 2:
        return []
    busy = ", ".join(f"{w} {seconds:.0f} s" for w, seconds in sorted(workers.items()))
    out = [f"{lane.name}: its workers busy {busy}; its {min(longest, len(files))} longest files (s):"]
    for name, seconds in sorted(files.items(), key=lambda f: f[1], reverse=True)[:longest]:
        out.append(f"  {seconds:7.0f}  {name}")
    return out


def total_seconds(folder: Path) -> float | None:
    """From the first phase's start to the last end recorded: a phase's, or that of a pytest run in a
    phase that failed (whose end was never marked)."""
    phases = read_phases(folder)
    ends = [end for _, _, end in phases if end] + [lane.ended for lane in read_lanes(folder)]
    return max(ends) - phases[0][1] if phases and ends else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.timeline", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    mark = commands.add_parser("mark", help="Mark a phase's start or end in FOLDER/phases.jsonl.")
    mark.add_argument("folder", type=Path)
    mark.add_argument("phase")
    mark.add_argument("event", choices=("start", "end"))
    show = commands.add_parser("summary", help="Print the phases' wall times and the slowest tests.")
    show.add_argument("folder", type=Path)
    show.add_argument("--slowest", type=int, default=20)
    show.add_argument("--limit-minutes", type=float, default=None,
                      help="Fail (exit 1) when the phases took longer than this, naming the slowest tests.")
    args = parser.parse_args(argv)

    if args.command == "mark":
        args.folder.mkdir(parents=True, exist_ok=True)
        with (args.folder / PHASES).open("a") as f:
            f.write(json.dumps({"phase": args.phase, "event": args.event, "at": time.time()}) + "\n")
        return 0

    text, tests = summary(args.folder, args.slowest)
    print(text)
    total = total_seconds(args.folder)
    if total is not None:
        print(f"In all: {minutes(total)}")
    if args.limit_minutes is not None and total is not None and total > args.limit_minutes * 60:
        names = ", ".join(f"{e.test} ({e.duration:.0f} s)" for e in tests[:5])
        print(f"FAILED: the run took {minutes(total)}, past its limit of {args.limit_minutes:g} minutes. The slowest "
              f"tests: {names}. Share their runs or make them cheaper (docs/testing.md).", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
