"""Every private PyTorch API trnflow uses, each in one place, with what it stands in for.

PyTorch may change a private name in any release without notice. `TORCH_CHECKED` is the release
these were checked against; tests/unit/test_private_torch.py fails on another release, naming this
module, until each use below is checked again (and the tensor-parallel styles' override of
`ColwiseParallel`/`RowwiseParallel._apply`, in `trnflow.device.tensor_parallel`).
Only torch itself is imported here at first; each distributed piece is imported where it is used.
"""

from __future__ import annotations

from typing import Any

import torch

TORCH_CHECKED = "2.13"
"""The torch release (major.minor) whose private APIs below were checked."""


def strided_shard(dim: int, parts: int) -> Any:
    """A DTensor placement that splits `dim` part by part, each of `parts` equal parts split alike
    over the mesh (GPT-2's fused query, key and value). Public DTensor has only `Shard`, which would
    give a core a slice across the parts' boundary: `_StridedShard` is the placement DTensor itself
    uses for exactly this (FSDP2 over tensor parallelism)."""
    from torch.distributed.tensor.placement_types import _StridedShard  # DTensor: split models only

    return _StridedShard(dim, split_factor=parts)


def in_parts(placement: Any) -> bool:
    """Whether `placement` is a `strided_shard`."""
    from torch.distributed.tensor.placement_types import _StridedShard  # DTensor: split models only

    return isinstance(placement, _StridedShard)


def whole_graphs_under_ddp() -> None:
    """Keep TorchDynamo from splitting the graph of a model that DDP wraps at the boundaries of
    DDP's gradient buckets (`torch._dynamo.config.optimize_ddp`, on by default), which it does so
    each bucket's all-reduce can start while the rest of the backward runs. The compile stage's
    trial runs the model unwrapped, as one graph, and so does Neuron: a model over DDP's first
    bucket (1 MB of weights) would train on graphs the cache never held. The process's setting;
    the replicas' gradients are then averaged after the compiled backward."""
    torch._dynamo.config.optimize_ddp = False


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors in one flat buffer, for one all-reduce instead of one per tensor: what DDP's
    gradient buckets do inside, which no public function offers (`torch._utils`)."""
    return torch._utils._flatten_dense_tensors(tensors)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flatten`'s buffer back as tensors shaped as `like`."""
    return list(torch._utils._unflatten_dense_tensors(flat, like))


def load_without_group(state: dict[str, Any], reader: Any, planner: Any) -> None:
    """Load a DCP checkpoint into `state` in this process alone, with no process group: the public
    `torch.distributed.checkpoint.load` asks for one whenever torch.distributed is available;
    `_load_state_dict(..., no_dist=True)` is what it calls underneath."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # sharded checkpoints only

    _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True)


def fake_group(world_size: int) -> None:
    """This process as rank 0 of a stand-in group of `world_size` ranks whose collectives move
    nothing: PyTorch's `fake` backend, registered by its test module (the compile stage's trial of
    a rank whose layers are split `world_size` ways; there is no public one)."""
    import torch.distributed as dist  # the compile stage's trial of a split model only
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the fake backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def set_element(tree: dict[str, Any], path: Any, value: Any) -> None:
    """Put `value` at `path` of a nested state dict, as DCP's own loader does when it unflattens
    one (`torch.distributed.checkpoint._traverse`): a loader that reads a value itself must too."""
    from torch.distributed.checkpoint._traverse import set_element as put  # sharded checkpoints only

    put(tree, path, value)


def empty_load_planner() -> type:
    """DCP's planner that loads a checkpoint into an empty state dict, taking its shape from the
    checkpoint's index (`_EmptyStateDictLoadPlanner`; `dcp.format_utils` uses it for the same)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner  # sharded only

    return _EmptyStateDictLoadPlanner


def storage_info() -> type:
    """The record a DCP index keeps per stored item (`torch.distributed.checkpoint.filesystem
    ._StorageInfo`): one of the few types the index may hold, checked before it is trusted."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # sharded checkpoints only

    return _StorageInfo


PICKLED_NAMES = (("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                 ("torch.serialization", "_get_layout"))
"""Private names a DCP index's pickle refers to, which its safe reader lets through (`trnflow.workload.sharding`)."""


def recompute_without_forward_side_effects() -> None:
    """Let TorchDynamo trace a recomputed block (`torch.utils.checkpoint`) whose forward changes
    Python state outside it, without replaying that change when backward recomputes the block: a
    transformers decoder layer records its outputs in a context variable (for `output_hidden_states`,
    which training never asks for), which Dynamo otherwise refuses inside a checkpoint. The flag is
    the one Dynamo's own refusal names."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def checkpoint_operator() -> Any:
    """The higher-order operator TorchDynamo traces `torch.utils.checkpoint` into; None where this
    PyTorch has none."""
    return getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)


def checkpoint_context(body: torch.fx.GraphModule) -> Any:
    """The context function (selective recomputation's policy) Dynamo keeps with a recomputed
    block's traced body; None for a body without one."""
    return body.meta.get("_checkpoint_context_fn")
