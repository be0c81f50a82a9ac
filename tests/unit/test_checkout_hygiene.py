"""The README's two commands in a newcomer's order: CI runs the demo, then the tests, in one clone;
no test sees what the demo left, and a test that writes into the checkout fails the session."""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import ROOT, changed, checkout_files


def test_ci_runs_the_demo_then_the_tests_in_the_same_clone():
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert [step.split()[:2] for step in steps] == [["make", "demo"], ["make", "test"]]
    assert steps[1] == 'make test TIMELINE="$TIMELINE" TIMELINE_OF=ci'  # its timeline beside the demo's


def test_each_test_starts_in_an_empty_folder_outside_the_checkout():
    here = Path.cwd()
    assert here != ROOT and ROOT not in here.parents and not any(here.iterdir())


def test_the_checkout_check_sees_a_file_added_changed_or_deleted_and_ignores_caches(tmp_path):
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    kept, gone = tmp_path / "runs" / "quickstart" / "metrics.json", tmp_path / "README.md"
    kept.write_text("{}")
    gone.write_text("# hello")
    before = checkout_files(tmp_path)
    for cache in (".venv/lib/x.py", "trnflow/__pycache__/a.pyc", ".pytest_cache/v", "trnflow.egg-info/PKG-INFO",
                  "runs/test-timeline/integration.jsonl"):
        (tmp_path / cache).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / cache).write_text("x")
    assert changed(before, checkout_files(tmp_path)) == []
    kept.write_text('{"accuracy": 0.5}')
    os.utime(kept, ns=(before["runs/quickstart/metrics.json"][1] + 10**9,) * 2)
    gone.unlink()
    (tmp_path / ".trnflow" / "jobs").mkdir(parents=True)
    (tmp_path / ".trnflow" / "jobs" / "job.json").write_text("{}")
    assert changed(before, checkout_files(tmp_path)) == [".trnflow/jobs/job.json", "README.md",
                                                         "runs/quickstart/metrics.json"]
