"""Activation checkpointing (`train.activation_checkpointing`): the recipe's blocks recompute in
the backward pass what their forward pass computed, instead of keeping it in device memory.

- `full`: a block keeps only its inputs; its backward runs its forward again first.
- `selective`: a block keeps the outputs of the operations that are dear to compute again (the
  recipe's `saved_ops`: matrix products and attention by default) and recomputes the rest
  (normalizations, activations, dropout, softmax), which costs little time and most of the memory.

Each block's forward is wrapped in PyTorch's non-reentrant `torch.utils.checkpoint.checkpoint`,
which TorchDynamo traces into the graph the compile stage builds (the recomputation is part of the
backward graph). Random operations replay the same stream when they run again (eagerly, the
checkpoint's `preserve_rng_state`; compiled, AOT autograd's partitioner, which is why the emulator
lowers such a graph even at O1), so a run's losses and weights do not depend on the setting. The blocks keep
their names, parameters and hooks: checkpoints, sharding and tensor parallelism see the same model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from trnflow.device.private_torch import recompute_without_forward_side_effects

SETTINGS = ("none", "selective", "full")
"""From the most memory kept to the least (and from the least time to the most)."""


def _aten(names: Iterable[str]) -> set[Any]:
    """The ATen overload packets of `names` that this PyTorch has."""
    return {getattr(torch.ops.aten, name) for name in names if hasattr(torch.ops.aten, name)}


def _selective(saved: set[Any]) -> Callable[[], Any]:
    """The checkpoint's context function that keeps the outputs of `saved` and recomputes the rest."""
    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        return CheckpointPolicy.MUST_SAVE if packet in saved else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    # what the compile cache's key says of it: the graph holds only the operator's name
    context.trnflow_policy = "selective, keeping " + ", ".join(sorted(str(op) for op in saved))  # type: ignore[attr-defined]
    return context


def recompute(blocks: list[nn.Module], setting: str, saved_ops: Iterable[str]) -> int:
    """Make each of `blocks` recompute its activations in backward as `setting` says (`SETTINGS`),
    a selective one keeping the outputs of `saved_ops` (ATen names: the recipe's); how many were
    wrapped (none for `none`, or a recipe that names no blocks). A block wrapped already is left
    as it is."""
    if setting not in SETTINGS:
        raise ValueError(f"activation checkpointing {setting!r}: the settings are {', '.join(SETTINGS)}")
    if setting == "none":
        return 0
    recompute_without_forward_side_effects()  # a transformers layer's output recording: never replayed
    # TorchDynamo takes a context function it can read (not PyTorch's own no-op): full passes none
    options = {"context_fn": _selective(_aten(saved_ops))} if setting == "selective" else {}
    wrapped = 0
    for block in blocks:
        if getattr(block, "_trnflow_recompute", None) is not None:
            continue
        forward = block.forward

        def run(*args: Any, _forward: Callable[..., Any] = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # an evaluation: nothing is kept, so its graph is the plain one
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, **options, **kwargs)

        block.forward = run  # type: ignore[method-assign]  # the module's own call (its hooks) is unchanged
        block._trnflow_recompute = setting  # type: ignore[assignment]
        wrapped += 1
    return wrapped
