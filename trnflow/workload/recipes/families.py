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

from trnflow.device.layout import TensorPlan
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
    "gpt2": (("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")),
    "bert": (("attention.self.query", "attention.self.key", "attention.self.value", "intermediate.dense"),
             ("attention.output.dense", "output.dense")),
}
"""Per family, the layers of a transformer layer (paths inside it) split by output, then by input."""
FUSED = {"gpt2": {"attn.c_attn": 3}}
"""Per family, the column-parallel layers whose output is several parts side by side (GPT-2's query,
key and value), by how many."""
HEADS = ("num_attention_heads", "num_key_value_heads")
"""The config's head counts every tp must divide (a Llama's key/value heads may be fewer than its query heads)."""


def _parts(block: nn.Module, path: str, column: bool) -> list[str]:
    """The layers that stand for `path`: itself, or, with a LoRA adapter on it (peft's layer, with
    `base_layer`), the base layer and the adapter's matrix on the split side (lora_B of a
    column-parallel layer, lora_A of a row-parallel one), the other adapter matrix staying whole: its
    rank-r side is small, and its product sums as the base layer's does."""
    layer = block.get_submodule(path)
    if not hasattr(layer, "base_layer"):
        return [path]
    side = "lora_B" if column else "lora_A"
    return [f"{path}.base_layer", *(f"{path}.{side}.{name}" for name in getattr(layer, side))]


def _width(layer: nn.Module, column: bool) -> int:
    """A layer's outputs (`column`) or inputs: of a linear layer's weight [out, in], or of GPT-2's
    Conv1D's [in, out]."""
    weight = getattr(layer, "base_layer", layer).weight
    out_first = isinstance(getattr(layer, "base_layer", layer), nn.Linear)
    return weight.shape[0 if out_first == column else 1]


def tensor_plan(config: Any, blocks: list[nn.Module], tp: int) -> TensorPlan:
    """The split of a model's transformer layers (`blocks`) over `tp` cores, by its `transformers`
    config; FieldError when its family has none, or `tp` does not divide its heads or its layers' widths."""
    model_type = config.model_type
    family = FAMILIES.get(model_type)
    if family not in SPLITS:
        known = sorted(k for k, v in FAMILIES.items() if v in SPLITS)
        raise FieldError("train.parallelism.tp", f"trnflow knows no tensor-parallel split of {model_type!r} models "
                         f"(it knows {known}); use tp: 1, and strategy fsdp for a model too big for one core")
    for name in HEADS:
        heads = getattr(config, name, None)
        if isinstance(heads, int) and heads % tp:
            raise FieldError("train.parallelism.tp", f"{tp} does not divide the model's {heads} attention heads "
                             f"({name}): each core computes whole heads; use a tp that divides {heads}")
    if not blocks:
        raise FieldError("train.parallelism.tp", f"the {model_type} model has no transformer layers to split")
    colwise, rowwise = SPLITS[family]
    fused = FUSED.get(family, {})
    first = blocks[0]
    for path in (*colwise, *rowwise):
        width = _width(first.get_submodule(path), path in colwise) // fused.get(path, 1)
        if width % tp:
            side = "outputs" if path in colwise else "inputs"
            raise FieldError("train.parallelism.tp", f"{tp} does not divide the {width} {side} of {path}; use a "
                             "tp that divides it")
    parts = {part: n for path, n in fused.items() for part in _parts(first, path, True)}
    resize = (("attn", "split_size", config.hidden_size // tp),) if family == "gpt2" else ()
    return TensorPlan(tuple(blocks), tuple(p for path in colwise for p in _parts(first, path, True)),
                      tuple(p for path in rowwise for p in _parts(first, path, False)), parts, resize)
