"""What names a run, and what makes a run a retraining: rules the command line, the flows and the
workload all apply, kept here once."""

from __future__ import annotations

import re
import time
import uuid

RUN_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""A run id: it names the run's checkpoint folder, so letters, digits, '.', '_' and '-' only."""
PREFLIGHT_FOLDER = "_preflight"
"""The folder in a run's checkpoint folder where the preflight's checkpoint round trip writes: never
a run id (the preflight's IAM role may write only there), never a `step-*` checkpoint."""

RETRAINED = {"train.init_from": "champion", "data.window": "since-watermark"}
"""What retraining changes in a spec: it starts from the champion, on the days after its watermark."""


def run_id_problem(run_id: str) -> str | None:
    """What is wrong with a run id, or None."""
    if not RUN_ID.fullmatch(run_id) or run_id in (".", ".."):
        return f"{run_id!r}: use letters, digits, '.', '_' and '-' only (at most 128)"
    if run_id == PREFLIGHT_FOLDER:
        return f"{run_id!r} is the preflight's folder; name the run otherwise"
    return None


def new_run_id(suffix: str | None = None) -> str:
    """A fresh run id: the time it starts, then `suffix` (a flow run's id, say) or a random one."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{suffix or uuid.uuid4().hex[:8]}"
