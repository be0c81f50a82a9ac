"""Sharded training's state, whole: a sharded model's weights and optimizer state gathered into the
plain, unsharded form every checkpoint holds, and loaded back into a model sharded over any number
of ranks.

Under `train.parallelism.strategy: fsdp` each rank keeps 1/N of every weight and of its optimizer
state (DTensors). A checkpoint holds them whole, as `ddp` writes them, so that evaluation, the
registry, inference and plain PyTorch load it as they load any other, and a run resumes from it at
any world size: loading shards it again over the ranks there are. The optimizer's state is keyed by
parameter name (`get_optimizer_state_dict`), which needs no parameter order; a `ddp` checkpoint's,
keyed by position, is read by the same names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

WHOLE = StateDictOptions(full_state_dict=True)
"""Loading: every rank passes the whole state, and keeps its shard."""
WHOLE_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Saving: unsharded tensors in host memory, on rank 0 only (the others get nothing)."""


def whole_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights, unsharded, on rank 0 (a collective: every rank calls it)."""
    return get_model_state_dict(model, options=WHOLE_ON_RANK0)


def whole_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state, unsharded and keyed by parameter name, on rank 0 (a collective)."""
    return get_optimizer_state_dict(model, optimizer, options=WHOLE_ON_RANK0)


def load_whole(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, torch.Tensor],
               state: dict[str, Any] | None) -> None:
    """Load unsharded weights (and optimizer state) into a sharded model: each rank keeps its shard.
    Every rank passes the whole state (a collective)."""
    set_model_state_dict(model, weights, options=WHOLE)
    if optimizer is not None and state is not None:
        set_optimizer_state_dict(model, optimizer, by_name(model, optimizer, state), options=WHOLE)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state into an unsharded model's optimizer: as it was saved when
    keyed by position (a `ddp` checkpoint), by name when a sharded run saved it."""
    if _by_name(state):
        set_optimizer_state_dict(model, optimizer, state, options=WHOLE)
    else:
        optimizer.load_state_dict(state)


def _by_name(state: dict[str, Any]) -> bool:
    return all(isinstance(k, str) for k in state.get("state", {})) and all(
        isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"])


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name. One keyed by position (`optimizer.state_dict()`,
    as `ddp` saves it) is renamed through this optimizer's parameter groups, whose order it follows."""
    if _by_name(state):
        return state
    names = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
    position = {index: names[id(p)] for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True)
                for index, p in zip(saved["params"], group["params"], strict=True)}
    return {"state": {position[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [position[i] for i in g["params"]]} for g in state["param_groups"]]}
