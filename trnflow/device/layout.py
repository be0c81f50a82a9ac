"""How tensor parallelism splits a model: the plan a recipe gives (`Recipe.tensor_plan`) and the
device carries out (`Device.split`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorPlan:
    """How tensor parallelism splits a model (`Recipe.tensor_plan`): in each of `blocks`, the linear
    layers named in `colwise` (paths inside the block) split by their outputs and those in `rowwise`
    by their inputs. Everything else stays whole on every core."""

    blocks: tuple[Any, ...]
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    parts: dict[str, int] = field(default_factory=dict)
    """Column-parallel layers whose output is several equal parts side by side (GPT-2's c_attn: query,
    key and value), by how many: each part splits alike."""
    resize: tuple[tuple[str, str, int], ...] = ()
    """Attributes set on each block's modules once split: (path, attribute, value), such as the width
    GPT-2's attention splits its fused output at."""

    def split_parameters(self) -> tuple[int, int]:
        """How many of the model's parameters are split, and how many of those train: the layers'
        weights, and the biases of the column-parallel ones (a row-parallel layer's bias is added once,
        after the sum, whole)."""
        split = [p for block in self.blocks for path in self.colwise
                 for p in block.get_submodule(path).parameters()]
        split += [block.get_submodule(path).weight for block in self.blocks for path in self.rowwise]
        return sum(p.numel() for p in split), sum(p.numel() for p in split if p.requires_grad)
