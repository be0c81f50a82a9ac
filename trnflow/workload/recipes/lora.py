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

import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

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
        return peft.get_peft_model(model, config)


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
