"""Which of a failed job's rank reports is the root cause: a rank's own error comes before its
peers' complaints about the broken link, and a rank that died without a word (SIGKILL, the OOM
killer) is a lost worker, which a retry can cure. Shared by the local backend and the cloud
container, so both classify a failure alike."""

from __future__ import annotations

import json
from pathlib import Path

_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "gloo", "Broken pipe")
_TIMEOUT_SIGNS = ("Application timeout caused pair closure", "Timed out waiting")


def lost_peer(report: dict) -> bool:
    """Whether a rank's error only says that a peer went away."""
    text = f"{report.get('type')}: {report.get('message')}"
    return report.get("type") == "DistBackendError" or any(sign in text for sign in _PEER_SIGNS)


def read_reports(output_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(output_dir.glob("failure-rank*.json"))]


def root_failure(reports: list[dict], processes: int, first_rank: int = 0) -> dict:
    """The failure that caused the others among ranks `first_rank`.. of `processes` ranks;
    `retryable` says whether a retry can help."""
    own = [r for r in reports if r.get("retryable") is not None]
    if own:
        return min(own, key=lambda r: r["rank"])
    waited = [r for r in reports if r.get("type") in ("RuntimeError", "DistBackendError")
              and any(sign in str(r.get("message")) for sign in _TIMEOUT_SIGNS)]
    causes = [r for r in reports if not lost_peer(r) and r not in waited]
    if causes:
        return min(causes, key=lambda r: r["rank"])  # a plain error (a bug): not retryable
    silent = sorted(set(range(first_rank, first_rank + processes)) - {r["rank"] for r in reports})
    if waited:  # the ranks that reported timed out waiting for the silent ones
        who = f"rank(s) {silent} stopped answering" if silent else "the ranks waited for each other"
        return {"type": "CollectiveTimeout", "retryable": True, "ranks": silent,
                "message": f"{who}: rank(s) {[r['rank'] for r in waited]} timed out waiting in a collective "
                           f"({waited[0].get('message')}); a retry resumes from the last checkpoint"}
    return {"type": "WorkerLost", "retryable": True, "ranks": silent,
            "message": f"rank(s) {silent} exited without reporting why (killed, or out of memory)"}
