"""LoRA adapters on a `transformers` model, built with `peft`: the pretrained weights stay frozen and
only two small matrices beside each chosen projection train.

`model.params.lora` on `hf-causal-lm` and `hf-encoder` turns it on. The adapted model is a
`peft.PeftModel` around the pretrained one, so that the adapter saves in PEFT's own format
(`adapter_config.json`, `adapter_model.safetensors`) and merges into the base with
`merge_and_unload`. The pipeline needs nothing LoRA-specific: a parameter that does not train is
frozen (`requires_grad` off), and the optimizer, the checkpoints and the memory planner leave
frozen weights out; checkpoints name the frozen base instead by its content digest
(`folder_digest`), which every load compares with the spec's.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trnflow.errors import FieldError
from trnflow.lifecycle.exports import listing
from trnflow.records import ADAPTER_FOLDER, manifest_digest
from trnflow.workload.recipes.families import FAMILIES

TARGETS = {
    "llama": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "gpt2": ("c_attn", "c_proj", "c_fc"),
    "bert": ("query", "key", "value", "dense"),
}
"""The default layers adapted, per family: every linear layer of the block, the attention's and the
MLP's (the field's practice since QLoRA: adapting the attention alone learns markedly less). GPT-2's
`c_proj` is the attention's and the MLP's output projection alike; BERT's `dense` its attention's
output, intermediate and output layers."""


class LoraParams(BaseModel):
    """LoRA's settings, as `peft.LoraConfig` takes them."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, le=1024, description="The adapter's rank: the inner width of each pair of matrices.")
    alpha: float = Field(32.0, gt=0, le=1e6, description="The adapter's scale is alpha / r (peft's lora_alpha).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input while training "
                           "(peft's lora_dropout).")
    target_modules: list[str] | None = Field(
        None, min_length=1,
        description="Names (last parts) of the linear layers to adapt. Default: every linear layer of the block: "
        "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (Llama-style decoders: llama, qwen2, qwen3, "
        "mistral, gemma, ...), c_attn, c_proj and c_fc (GPT-2), query, key, value and dense (BERT-style encoders).")


def targets(params: LoraParams, model_type: str) -> list[str]:
    """The layers to adapt: the params' own, else the family's default; FieldError when there is none."""
    if params.target_modules:
        return list(params.target_modules)
    family = FAMILIES.get(model_type)
    if family is None:
        raise FieldError("model.params.lora.target_modules", f"there is no default for model type {model_type!r}; "
                         "name the linear layers to adapt (for example [q_proj, v_proj])")
    return list(TARGETS[family])


def adapt(model: Any, params: LoraParams, model_type: str) -> Any:
    """`model` with LoRA adapters on its target layers (a `peft.PeftModel`): only the adapters train."""
    try:
        import peft  # optional (the hf extra), and heavy
    except ModuleNotFoundError:
        raise FieldError("model.params.lora", "LoRA needs peft, which is not installed here: "
                         "pip install 'trnflow[hf]'") from None
    names = targets(params, model_type)
    found = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    if missing := [n for n in names if n not in found]:
        raise FieldError("model.params.lora.target_modules", f"the {model_type} model has no layers named "
                         f"{missing}; its layers include {sorted(found)[:12]}")
    config = peft.LoraConfig(r=params.r, lora_alpha=params.alpha, lora_dropout=params.dropout, target_modules=names,
                             fan_in_fan_out=FAMILIES.get(model_type) == "gpt2")  # GPT-2's Conv1D keeps W transposed
    with warnings.catch_warnings():  # peft reads transformers' deprecated alias: nothing a user can act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        adapted = peft.get_peft_model(model, config)
    fast = _low_rank_first(peft.tuners.lora.Linear)
    for module in adapted.modules():
        if type(module) is peft.tuners.lora.Linear:
            module.__class__ = fast
    return adapted


@functools.cache
def _low_rank_first(linear: type) -> type:
    """peft's LoRA `Linear` with a faster forward for plain LoRA (one adapter, no dropout, no bias,
    no variant such as DoRA, weights not split over cores): the scale applied to the rank-r
    activations, and their product with B added to the layer's output in one `addmm` against B's
    transpose. peft's `B(A(x)) * scale` scales and adds the layer's whole output, and computes B's
    gradient as `gradᵀ @ A(x)`, a product of a wide matrix with a skinny one that CPU BLAS runs up to
    ten times slower than its transpose (a fine-tune's LoRA step here lost a sixth of its time to
    it); B's transpose as the product's right side makes autograd compute both of B's products the
    fast way round. The same sums in another order: equal within rounding. Merging, saving and
    everything else are peft's."""

    class LowRankFirst(linear):
        def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            adapter = self.active_adapters[0] if len(self.active_adapters) == 1 else None
            if (args or kwargs or adapter is None or self.disable_adapters or self.merged or adapter not in self.lora_A
                    or adapter in self.lora_variant or not isinstance(self.lora_dropout[adapter], nn.Identity)
                    or self.lora_A[adapter].bias is not None or self.lora_B[adapter].bias is not None):
                return super().forward(x, *args, **kwargs)
            a, b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
            if not (_plain(a) and _plain(b)):  # split over cores (a DTensor): peft's own
                return super().forward(x, *args, **kwargs)
            result = self.base_layer(x)
            low = F.linear(self._cast_input_dtype(x, a.dtype), a) * self.scaling[adapter]
            summed = torch.addmm(result.reshape(-1, result.shape[-1]), low.reshape(-1, low.shape[-1]),
                                 b.t().contiguous())
            return summed.view(result.shape).to(result.dtype)

    LowRankFirst.__name__ = LowRankFirst.__qualname__ = "Linear"  # peft's repr and messages name it so
    return LowRankFirst


def _plain(weight: torch.Tensor) -> bool:
    return type(weight) in (torch.Tensor, nn.Parameter)


def unwrapped(model: Any) -> Any:
    """The `transformers` model itself: inside its adapter wrapper, or `model`."""
    return model.get_base_model() if hasattr(model, "peft_config") else model


def save_adapted(model: Any, folder: Path) -> None:
    """The adapter alone in PEFT's format under `folder/adapter/` (`PeftModel.from_pretrained(base,
    folder/adapter)` loads it), then the model merged into plain weights in `folder` itself
    (`from_pretrained(folder)` loads it, without peft)."""
    model.save_pretrained(folder / ADAPTER_FOLDER)
    model.merge_and_unload().save_pretrained(folder)


def folder_digest(folder: Path) -> str:
    """The content digest of a pretrained folder: every file's name, sha256 and size (the `EXPORTED`
    marker's own listing, for a folder trnflow exported, so a registered version's export digest is
    its digest as a base)."""
    return manifest_digest(listing(folder))
