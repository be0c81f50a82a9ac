"""Which of a failed job's rank reports is the root cause: a rank's own error comes before its
peers' complaints about the broken link, and a rank that died without a word (SIGKILL, the OOM
killer) is a lost worker, which a retry can cure. Shared by the local backend and the cloud
container, so both classify a failure alike."""

from __future__ import annotations

import json
from pathlib import Path

_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "gloo", "Broken pipe")


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
    causes = [r for r in reports if not lost_peer(r)]
    if causes:
        return min(causes, key=lambda r: r["rank"])  # a plain error (a bug): not retryable
    silent = sorted(set(range(first_rank, first_rank + processes)) - {r["rank"] for r in reports})
    return {"type": "WorkerLost", "retryable": True, "ranks": silent,
            "message": f"rank(s) {silent} exited without reporting why (killed, or out of memory)"}
