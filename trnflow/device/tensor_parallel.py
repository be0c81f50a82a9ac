"""Tensor parallelism's layer styles, over PyTorch's own (`torch.distributed.tensor.parallel`).

A `TensorPlan` names layers to split by output (column-parallel) and by input (row-parallel).
`nn.Linear` layers take PyTorch's `ColwiseParallel` and `RowwiseParallel` as they are. A layer that
stores its weight as [in, out] (GPT-2's `Conv1D`, which computes `x @ W + b`) splits along the other
dimension, and a column-parallel layer whose output is several equal parts side by side (GPT-2's
`c_attn`: query, key and value) splits each part alike, so that each core's output is its heads'
query, key and value (`private_torch.strided_shard`, the placement DTensor has for exactly that).
The two styles below override PyTorch's private `_apply`, with its `_prepare_input_fn` and
`_prepare_output_fn` (no public hook says how a style splits its parameters);
`trnflow.device.private_torch` names the release they were checked against.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from trnflow.device.layout import TensorPlan
from trnflow.device.private_torch import strided_shard


def _local(module: nn.Module, outputs: Any, mesh: Any) -> Any:
    """This core's part of a column-parallel layer's output, as its computation placed it."""
    return outputs.to_local()


class _PartsColwise(ColwiseParallel):
    """Column-parallel for a weight stored [in, out] (`out_dim` 1) or a linear layer's (0): split
    along its outputs (the bias along dim 0), in `parts` equal parts each split alike."""

    def __init__(self, parts: int, out_dim: int):
        super().__init__()
        self.parts, self.out_dim = parts, out_dim

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        for key, param in module.named_parameters(recurse=False):
            dim = self.out_dim if param.ndim == 2 else 0
            placement = strided_shard(dim, self.parts) if self.parts > 1 else Shard(dim)
            module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                        requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        inputs = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        return distribute_module(module, device_mesh, self._partition, inputs, _local)


class _InOutRowwise(RowwiseParallel):
    """Row-parallel for a weight stored [in, out]: split along its inputs (dim 0); its bias whole,
    added once to the sum."""

    def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
        for key, param in module.named_parameters(recurse=False):
            placement = Shard(0) if param.ndim == 2 else Replicate()
            module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [placement]),
                                                        requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # this core's part of the inputs
        inputs = partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        outputs = partial(self._prepare_output_fn, self.output_layouts, self.use_local_output)
        return distribute_module(module, device_mesh, self._partition, inputs, outputs)


def _style(layer: nn.Module, column: bool, parts: int) -> ParallelStyle:
    linear = isinstance(layer, nn.Linear)
    if linear and parts == 1:
        return ColwiseParallel() if column else RowwiseParallel()
    return _PartsColwise(parts, 0 if linear else 1) if column else _InOutRowwise()


def split(plan: TensorPlan, mesh: Any) -> None:
    """Split each of the plan's blocks over the 1-D `mesh`, in place, then set the attributes its
    modules need changed for their split widths (`TensorPlan.resize`)."""
    for block in plan.blocks:
        styles = {path: _style(block.get_submodule(path), path in plan.colwise, plan.parts.get(path, 1))
                  for path in (*plan.colwise, *plan.rowwise)}
        parallelize_module(block, mesh, styles)
        for path, attribute, value in plan.resize:
            setattr(block.get_submodule(path), attribute, value)
