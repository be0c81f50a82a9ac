"""What trnflow knows of the `transformers` architectures by family: which model types name their
layers alike, and how tensor parallelism splits each family's transformer layers.

A family's split follows Megatron-LM's pairing, as `transformers`' own `base_model_tp_plan` (Llama's)
and NxD's `ColumnParallelLinear`/`RowParallelLinear` do: the attention's query, key and value
projections and the MLP's first projections split by output (each core computes whole heads, and a
part of the MLP's hidden units), and the projections after them split by input, so each attention
and each MLP costs one sum across the cores. The embeddings, the norms and the output head stay whole
on every core (replicated): the vocabulary is not split.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trnflow.device.base import TensorPlan
from trnflow.errors import FieldError

FAMILIES = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                     "olmo", "olmo2", "granite", "smollm3"), "llama"),
    **dict.fromkeys(("gpt2", "gpt_bigcode"), "gpt2"),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "camembert", "electra"), "bert"),
}
"""Model types whose layers are named as the family's."""

SPLITS = {
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
              ("self_attn.o_proj", "mlp.down_proj")),
    "bert": (("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
             ("attention.output.dense", "output.dense")),
}
"""Per family, the layers of a transformer layer (paths inside it) split by output, then by input."""
HEADS = ("num_attention_heads", "num_key_value_heads")
"""The config's head counts every tp must divide (a Llama's key/value heads may be fewer than its query heads)."""


def _parts(block: nn.Module, path: str, column: bool) -> list[str]:
    """The linear layers that stand for `path`: itself, or, with a LoRA adapter on it (peft's layer,
    with `base_layer`), the base layer and the adapter's matrix on the split side (lora_B of a
    column-parallel layer, lora_A of a row-parallel one), the other adapter matrix staying whole: its
    rank-r side is small, and its product sums as the base layer's does."""
    layer = block.get_submodule(path)
    if not hasattr(layer, "base_layer"):
        return [path]
    side = layer.lora_B if column else layer.lora_A
    return [f"{path}.base_layer", *(f"{path}.{'lora_B' if column else 'lora_A'}.{name}" for name in side)]


def tensor_plan(model_type: str, config: dict[str, Any], blocks: list[nn.Module], tp: int) -> TensorPlan:
    """The split of a `model_type` model's transformer layers (`blocks`) over `tp` cores; FieldError
    when the family has none, or `tp` does not divide its heads or its layers' widths."""
    family = FAMILIES.get(model_type)
    if family not in SPLITS:
        why = ("GPT-2's attention computes its query, key and value in one fused layer (c_attn), which trnflow "
               "does not split yet" if family == "gpt2" else f"trnflow knows no tensor-parallel split of "
               f"{model_type!r} models (it knows {sorted(k for k, v in FAMILIES.items() if v in SPLITS)})")
        raise FieldError("train.parallelism.tp", f"{why}; use tp: 1, and strategy fsdp for a model too big "
                         "for one core")
    for name in HEADS:
        heads = config.get(name)
        if isinstance(heads, int) and heads % tp:
            raise FieldError("train.parallelism.tp", f"{tp} does not divide the model's {heads} attention heads "
                             f"({name}): each core computes whole heads; use a tp that divides {heads}")
    if not blocks:
        raise FieldError("train.parallelism.tp", f"the {model_type} model has no transformer layers to split")
    colwise, rowwise = SPLITS[family]
    first = blocks[0]
    for path in (*colwise, *rowwise):
        width = _width(first.get_submodule(path), path in colwise)
        if width % tp:
            side = "outputs" if path in colwise else "inputs"
            raise FieldError("train.parallelism.tp", f"{tp} does not divide the {width} {side} of {path}; use a "
                             "tp that divides it")
    return TensorPlan(tuple(blocks), tuple(p for path in colwise for p in _parts(first, path, True)),
                      tuple(p for path in rowwise for p in _parts(first, path, False)))


def _width(layer: nn.Module, column: bool) -> int:
    linear = getattr(layer, "base_layer", layer)
    return linear.out_features if column else linear.in_features
