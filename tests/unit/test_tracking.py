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
