"""Typed records as a test needs them: every required field filled with a plausible value."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from trnflow.records import CHECKPOINT_MARKER, CheckpointMeta, DataRead


def checkpoint_meta(run_id: str = "r", step: int = 40, files: tuple[str, ...] = (), **fields: Any) -> CheckpointMeta:
    """A checkpoint's meta.json as training writes it, with `fields` changed."""
    values: dict[str, Any] = {
        "run_id": run_id, "step": step, "global_step": step, "watermark": "2026-01-02", "spec_digest": "d",
        "precision": "fp32", "world_size": 1, "sampler": {"step": step}, "torch": "2",
        "recipe": {"recipe": "m5-text", "version": "1", "params": {}}, "data": DataRead(files=list(files), rows=100),
    }
    return CheckpointMeta(**{**values, **fields})


def commit(folder: Path) -> Path:
    """Write the folder's COMMITTED marker, listing each file in it with its sha256 and size, as a
    checkpoint's last write does: what registration reads and records."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != CHECKPOINT_MARKER}
    listed = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()}
    (folder / CHECKPOINT_MARKER).write_text(json.dumps({"files": listed}))
    return folder
