"""`hf-encoder`: a Hugging Face `transformers` encoder with a classification head, built in.

The encoder is built with `AutoModel.from_config` from a small config given in the params (no
download), or loaded from a local `save_pretrained` folder (safetensors). Its input is text,
tokenized by a byte-pair encoding trained on the first run's rows (as `m5-text` does, saved as
`tokenizer.json`), padded or cut to `seq_len`. The embedding is the encoder's last hidden state
mean-pooled over real tokens. At the end of a run the model is exported with `save_pretrained`
(`export`), so `AutoModel.from_pretrained` loads the trained encoder. Needs the `hf` extra
(`pip install 'trnflow[hf]'`): transformers 5 and safetensors, imported only when a model is built.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trnflow.errors import FatalError
from trnflow.workload.recipes.m5_text.params import PAD_ID
from trnflow.workload.recipes.m5_text.tokenizer import FILE, BpeTextRecipe

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


class HfEncoderParams(BaseModel):
    """The encoder's config (or its pretrained folder), the tokenizer and the head."""

    model_config = ConfigDict(extra="forbid")

    model_type: str = Field("bert", description="The transformers model type the config is for (bert, roberta, ...).")
    config: dict[str, Any] = Field(default_factory=lambda: dict(SMALL),
                                   description="Config fields of the encoder, as for AutoConfig.for_model.")
    pretrained: str | None = Field(None, description="A local save_pretrained folder to start the encoder from "
                                   "(config.json and model.safetensors); its config replaces `config`.")
    vocab_size: int = Field(4096, ge=256, le=1_000_000, description="Token vocabulary size of the tokenizer.")
    seq_len: int = Field(64, ge=4, le=8192, description="Fixed sequence length: texts are padded or cut.")
    num_classes: int = Field(2, ge=2, le=100_000, description="Number of output classes.")


def _transformers():
    try:
        import transformers  # optional (the hf extra), and heavy: ~2 s
    except ModuleNotFoundError:
        raise FatalError("model.recipe hf-encoder needs transformers: pip install 'trnflow[hf]'") from None
    return transformers


class EncoderClassifier(nn.Module):
    """The encoder, mean-pooled over real tokens, then a linear head."""

    def __init__(self, encoder: nn.Module, num_classes: int):
        super().__init__()
        if getattr(encoder, "pooler", None) is not None:  # its [CLS] pooler is not used: no untrained weights
            encoder.pooler = None
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != PAD_ID
        hidden = self.encoder(input_ids=tokens, attention_mask=keep.long()).last_hidden_state
        weights = keep.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class HfEncoder(BpeTextRecipe):
    """A transformers encoder (from a config or a save_pretrained folder) with a classification head."""

    name = "hf-encoder"
    version = "1"
    Params = HfEncoderParams
    params: HfEncoderParams

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The encoder's transformer layers, wherever the architecture keeps them (BERT's
        `encoder.layer`, DistilBERT's `transformer.layer`); none found: the whole model."""
        for module in model.modules():
            layers = getattr(module, "layer", None) or getattr(module, "layers", None)
            if isinstance(layers, nn.ModuleList) and len(layers):
                return list(layers)
        return []

    def build_model(self) -> EncoderClassifier:
        transformers, p = _transformers(), self.params
        if p.pretrained:
            folder = Path(p.pretrained)
            if not (folder / "config.json").is_file():
                raise FatalError(f"model.params.pretrained: {folder} has no config.json; give a folder written by "
                                 "save_pretrained")
            encoder = transformers.AutoModel.from_pretrained(folder, local_files_only=True)
            if encoder.config.vocab_size < p.vocab_size:
                raise FatalError(f"model.params.vocab_size: {p.vocab_size} is more than the pretrained encoder's "
                                 f"{encoder.config.vocab_size} token embeddings; set it to at most that")
        else:
            config = transformers.AutoConfig.for_model(
                p.model_type, **{"vocab_size": p.vocab_size, "max_position_embeddings": max(p.seq_len, 64),
                                 "pad_token_id": PAD_ID, **p.config})
            encoder = transformers.AutoModel.from_config(config)
        return EncoderClassifier(encoder, p.num_classes)

    def export(self, model: nn.Module, folder: Path) -> bool:
        """The trained model as `save_pretrained` writes it (the encoder: config.json and
        model.safetensors, which AutoModel.from_pretrained loads), beside the head's weights and the
        tokenizer."""
        assert isinstance(model, EncoderClassifier)
        model.encoder.save_pretrained(folder)
        torch.save(model.head.state_dict(), folder / "head.pt")
        (folder / FILE).write_bytes(self.state())
        (folder / "trnflow.json").write_text(json.dumps(self.describe(), indent=2))
        return True
