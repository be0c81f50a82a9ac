"""Typed records as a test needs them: every required field filled with a plausible value."""

from __future__ import annotations

from typing import Any

from trnflow.records import CheckpointMeta, DataRead


def checkpoint_meta(run_id: str = "r", step: int = 40, files: tuple[str, ...] = (), **fields: Any) -> CheckpointMeta:
    """A checkpoint's meta.json as training writes it, with `fields` changed."""
    values: dict[str, Any] = {
        "run_id": run_id, "step": step, "global_step": step, "watermark": "2026-01-02", "spec_digest": "d",
        "precision": "fp32", "world_size": 1, "sampler": {"step": step}, "torch": "2",
        "recipe": {"recipe": "m5-text", "version": 1, "params": {}}, "data": DataRead(files=list(files), rows=100),
    }
    return CheckpointMeta(**{**values, **fields})
