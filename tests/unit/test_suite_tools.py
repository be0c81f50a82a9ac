"""The suite's own tools: the timeline `make test` writes (tests/timeline.py) and the locks every
environment installs from (tests/deps.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import deps, timeline

ROOT = Path(__file__).resolve().parents[2]

SAMPLE = '''
import pytest

def test_one():
    pass

def test_two():
    assert False

@pytest.mark.skip(reason="no")
def test_three():
    pass
'''


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.timeline",
                           "test_sample.py", *args], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_each_test_is_written_with_its_worker_start_duration_and_outcome(tmp_path):
    done = _pytest(tmp_path, "--timeline", "out/unit.jsonl", "-n", "2")
    assert done.returncode == 1, done.stdout + done.stderr  # test_two fails
    rows = [json.loads(line) for line in (tmp_path / "out" / "unit.jsonl").read_text().splitlines()]
    session, tests = rows[0], {row["test"]: row for row in rows[1:]}
    assert session["lane"] == "unit" and session["ended"] >= session["started"]
    assert {name: row["outcome"] for name, row in tests.items()} == {
        "test_sample.py::test_one": "passed", "test_sample.py::test_two": "failed",
        "test_sample.py::test_three": "skipped"}
    assert {row["worker"] for row in tests.values()} <= {"gw0", "gw1"}
    assert all(row["duration"] >= 0 and row["start"] >= session["started"] - 1 for row in tests.values())


def test_without_the_option_nothing_is_written(tmp_path):
    _pytest(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["test_sample.py"]


def _timeline(folder: Path, phases: dict[str, tuple[float, float | None]], tests: dict[str, float]) -> Path:
    folder.mkdir()
    marks = [{"phase": name, "event": "start", "at": start} for name, (start, _) in phases.items()]
    marks += [{"phase": name, "event": "end", "at": end} for name, (_, end) in phases.items() if end is not None]
    (folder / timeline.PHASES).write_text("".join(json.dumps(m) + "\n" for m in marks))
    rows = [{"lane": "integration", "started": 100.0, "ended": 2900.0}]
    rows += [{"test": name, "worker": "gw0", "start": 100.0, "duration": d, "outcome": "passed"}
             for name, d in tests.items()]
    (folder / "integration.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_summary_gives_each_phase_and_the_slowest_tests_first(tmp_path, capsys):
    folder = _timeline(tmp_path / "t", {"demo": (0.0, 90.0), "integration": (100.0, 2900.0), "xla": (2900.0, None)},
                       {f"t.py::test_{i}": float(i) for i in range(30)})
    assert timeline.main(["summary", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "demo             1:30" in out and "integration     46:40" in out and "xla          unfinished" in out
    assert "The 20 slowest tests" in out
    listed = [line.split()[-1] for line in out.splitlines() if "t.py::test_" in line]
    assert listed == [f"t.py::test_{i}" for i in range(29, 9, -1)]
    assert "In all: 48:20" in out


def test_the_summary_gives_each_lanes_workers_and_longest_files(tmp_path, capsys):
    folder = _timeline(tmp_path / "t", {"integration": (100.0, 2900.0)},
                       {"a.py::test_1": 300.0, "b.py::test_1": 50.0, "a.py::test_2": 200.0, "c.py::test_1": 900.0})
    assert timeline.main(["summary", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "integration: its workers busy gw0 1450 s; its 3 longest files (s):" in out
    files = [line.split() for line in out.splitlines() if line.strip().endswith(".py")]
    assert files == [["900", "c.py"], ["500", "a.py"], ["50", "b.py"]]


def test_a_run_past_its_limit_fails_naming_the_slowest_tests(tmp_path, capsys):
    folder = _timeline(tmp_path / "t", {"demo": (0.0, 100.0), "integration": (100.0, 2900.0)},
                       {"a.py::test_long": 900.0, "b.py::test_short": 3.0})
    assert timeline.main(["summary", str(folder), "--limit-minutes", "49"]) == 0
    assert timeline.main(["summary", str(folder), "--limit-minutes", "48"]) == 1
    err = capsys.readouterr().err
    assert "the run took 48:20, past its limit of 48 minutes" in err and "a.py::test_long (900 s)" in err


def test_a_phase_that_failed_counts_to_the_end_of_its_pytest_run(tmp_path, capsys):
    folder = _timeline(tmp_path / "t", {"demo": (0.0, 90.0), "integration": (100.0, None)}, {"a.py::test_a": 1.0})
    assert timeline.main(["summary", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "integration  unfinished" in out and "In all: 48:20" in out  # the pytest run ended at 2,900 s


def test_marks_are_appended_as_phases(tmp_path):
    for event in ("start", "end"):
        assert timeline.main(["mark", str(tmp_path), "lint", event]) == 0
    [(name, start, end)] = timeline.read_phases(tmp_path)
    assert name == "lint" and end is not None and end >= start


def test_a_lock_is_the_environment_exactly(tmp_path, capsys):
    """Written from this environment, the lock verifies; one version changed, one package dropped
    and one added, each is named."""
    lock = tmp_path / "lock.txt"
    assert deps.main(["write", sys.executable, str(lock)]) == 0
    assert deps.main(["verify", sys.executable, str(lock)]) == 0
    lines = lock.read_text().splitlines()
    assert lines[0].startswith("# The versions `make test` last passed with")
    pins = [line for line in lines if "==" in line and not line.startswith("#")]
    name, version = pins[0].split("==")
    changed = [f"{name}==0.0.0", *pins[2:], "not-a-package==1.0"]
    lock.write_text("\n".join(changed) + "\n")
    assert deps.main(["verify", sys.executable, str(lock)]) == 1
    err = capsys.readouterr().err
    assert f"{deps.key(name)}: locked 0.0.0, installed {version}" in err
    assert f"{deps.key(pins[1].split('==')[0])}: " in err and "installed, not in the lock" in err
    assert "not-a-package: locked 1.0, not installed" in err


def test_names_compare_as_pip_normalises_them():
    assert deps.pinned(["# a comment", "", "Typing_Extensions==4.1  # why", "zope.interface==7"]) == {
        "typing-extensions": "4.1", "zope-interface": "7"}
