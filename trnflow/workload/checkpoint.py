"""Checkpoints: unsharded, written by rank 0, counted only once their commit marker exists.

Layout under `<checkpoint_url>/<run_id>/`:

    step-000040/model.pt     plain model state_dict (loads in any PyTorch program)
    step-000040/optim.pt     optimizer state_dict
    step-000040/state.pt     step, world size, every rank's RNG states
    step-000040/meta.json    lineage, spec digest, metrics so far
    step-000040/COMMITTED    written last: without it the folder is a torn write and is ignored
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trnflow.errors import FatalError
from trnflow.fsutil import atomic_write_bytes, atomic_write_json

MARKER = "COMMITTED"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / f"step-{step:06d}"


def committed_steps(run_dir: Path) -> list[int]:
    if not run_dir.is_dir():
        return []
    steps = []
    for child in run_dir.iterdir():
        if child.name.startswith("step-") and (child / MARKER).is_file():
            steps.append(int(child.name.removeprefix("step-")))
    return sorted(steps)


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = committed_steps(run_dir)
    return step_dir(run_dir, steps[-1]) if steps else None


def _save_tensor_file(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(obj, tmp)
    tmp.replace(path)


def save_checkpoint(run_dir: Path, step: int, model_state: dict, optim_state: dict,
                    rng_states: list[dict], meta: dict[str, Any]) -> Path:
    """Write one checkpoint; the COMMITTED marker goes last."""
    target = step_dir(run_dir, step)
    if target.exists():  # a torn write from an earlier attempt at this step
        shutil.rmtree(target)
    target.mkdir(parents=True)
    _save_tensor_file(target / "model.pt", model_state)
    _save_tensor_file(target / "optim.pt", optim_state)
    _save_tensor_file(target / "state.pt", {"step": step, "world_size": len(rng_states), "rng": rng_states})
    atomic_write_json(target / "meta.json", {**meta, "step": step, "saved_at": time.time()})
    atomic_write_bytes(target / MARKER, json.dumps({"step": step}).encode())
    return target


@dataclass
class Loaded:
    path: Path
    step: int
    model: dict
    optim: dict | None
    rng: list[dict] | None
    meta: dict


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle that weights_only refuses, truncation, not a torch file
        raise FatalError(f"{path}: cannot be loaded safely ({type(exc).__name__}: {exc})") from None


def load_checkpoint(path: Path) -> Loaded:
    """A trnflow checkpoint folder, or a plain `state_dict` file saved by any PyTorch program."""
    if path.is_file():
        state = _load(path)
        if not isinstance(state, dict):
            raise FatalError(f"{path}: expected a state_dict (a mapping of tensors), got {type(state).__name__}")
        return Loaded(path, 0, state, None, None, {})
    if not (path / MARKER).is_file():
        raise FatalError(f"{path}: not a committed checkpoint (no {MARKER} marker); pick another checkpoint")
    state = _load(path / "state.pt")
    meta = json.loads((path / "meta.json").read_text())
    return Loaded(path, int(state["step"]), _load(path / "model.pt"), _load(path / "optim.pt"),
                  state["rng"], meta)


def load_model_weights(model: torch.nn.Module, state: dict, source: Path) -> None:
    """Load weights, turning shape or key mismatches into an error that says which keys."""
    state = {k.removeprefix("module."): v for k, v in state.items()}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise FatalError(f"{source}: does not match the spec's model: {exc}") from None
    if result.missing_keys or result.unexpected_keys:
        raise FatalError(
            f"{source}: does not match the spec's model (missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}); check the model section"
        )
