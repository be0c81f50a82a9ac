"""The MLflow mirror's parts that need no server: the code version it records."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from trnflow.reporting.tracking import _commit


def test_the_commit_is_recorded_from_trnflows_own_checkout_only(tmp_path):
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / ".git").exists():  # a clone (CI's too); an unpacked source tarball has no commit
        assert re.fullmatch(r"[0-9a-f]{40}", _commit(checkout) or "")
    assert _commit(tmp_path) is None  # not a repository
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)  # someone else's repository
    (tmp_path / "trnflow").mkdir()
    assert _commit(tmp_path) is None


def test_a_run_that_waited_and_yielded_says_so_in_its_mlflow_tags():
    from tests.conftest import quickstart_data
    from trnflow.reporting.tracking import tracked_run
    from trnflow.results import RunOutcome, StageRow
    from trnflow.specs import validate_spec

    spec = validate_spec(quickstart_data(tracking={"mlflow_uri": "http://127.0.0.1:5000"}))
    rows = [StageRow(stage="queue", state="Waited", seconds=8.0, summary="behind run r1"),
            StageRow(stage="train", state="Preempted", seconds=5.0, summary="yielded to run p"),
            StageRow(stage="queue", state="Waited", seconds=42.0, summary="this machine is full"),
            StageRow(stage="train", state="Completed", seconds=30.0, summary="300 steps")]
    tags = tracked_run(spec, RunOutcome(run_id="r2", stages=rows), None, "summary").tags
    assert tags["trnflow.queue_wait_s"] == "50.0" and tags["trnflow.preemptions"] == "1"
    assert tags["trnflow.stage.train"].startswith("Preempted") and tags["trnflow.stage.train.2"].startswith("Completed")
    assert tags["trnflow.stage.queue.2"].startswith("Waited in 42.0 s")
