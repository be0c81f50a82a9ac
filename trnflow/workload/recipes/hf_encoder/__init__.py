"""`hf-encoder`: a Hugging Face `transformers` encoder with a classification head, built in.

The encoder is built with `AutoModel.from_config` from a small config given in the params (no
download), or loaded from a local `save_pretrained` folder (safetensors only, no remote code). Its
input is text padded or cut to `seq_len`, tokenized by the pretrained folder's own tokenizer when
it has one (the token ids the encoder learned), else by a byte-pair encoding trained on the first
run's rows (as `m5-text` does); either is saved beside every checkpoint as `tokenizer.json`. The
embedding is the encoder's last hidden state mean-pooled over real tokens. At the end of a run the
model is exported with `save_pretrained` (`export`), so `AutoModel.from_pretrained` and
`AutoTokenizer.from_pretrained` load the trained encoder and its tokenizer. Needs the `hf` extra
(`pip install 'trnflow[hf]'`): transformers 5 and safetensors, imported only when a model is built.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from pydantic import Field
from torch import nn

from trnflow.errors import FatalError
from trnflow.workload.recipes.hf_pretrained import (
    FromPretrained,
    PretrainedParams,
    PretrainedTokenizer,
    saved_state,
    transformers,
)
from trnflow.workload.recipes.lora import save_adapted
from trnflow.workload.recipes.m5_text.params import PAD_ID
from trnflow.workload.recipes.m5_text.tokenizer import FILE, BpeTextRecipe

SMALL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


class HfEncoderParams(PretrainedParams):
    """The encoder's config (or its pretrained folder), the tokenizer and the head."""

    model_type: str = Field("bert", description="The transformers model type the config is for (bert, roberta, ...).")
    config: dict[str, Any] = Field(default_factory=lambda: dict(SMALL),
                                   description="Config fields of the encoder, as for AutoConfig.for_model.")
    vocab_size: int = Field(4096, ge=256, le=1_000_000, description="Token vocabulary size of the tokenizer "
                            "trnflow trains (a pretrained folder's tokenizer keeps its own).")
    seq_len: int = Field(64, ge=4, le=8192, description="Fixed sequence length: texts are padded or cut.")
    num_classes: int = Field(2, ge=2, le=100_000, description="Number of output classes.")


class EncoderClassifier(nn.Module):
    """The encoder, mean-pooled over real tokens, then a linear head."""

    def __init__(self, encoder: nn.Module, num_classes: int, pad_id: int = PAD_ID):
        super().__init__()
        self.pad_id = pad_id
        if getattr(encoder, "pooler", None) is not None:  # its [CLS] pooler is not used: no untrained weights
            encoder.pooler = None
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != self.pad_id
        hidden = self.encoder(input_ids=tokens, attention_mask=keep.long()).last_hidden_state
        weights = keep.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class HfEncoder(FromPretrained, BpeTextRecipe):
    """A transformers encoder (from a config or a save_pretrained folder) with a classification head."""

    name = "hf-encoder"
    version = "1"
    Params = HfEncoderParams
    params: HfEncoderParams
    hf_tokenizer: PretrainedTokenizer | None = None
    """The featurizer when it is a pretrained folder's tokenizer (else `tokenizer`, trnflow's BPE)."""

    @property
    def pad_id(self) -> int:
        """The id the model masks out: the pretrained tokenizer's pad token, else trnflow's [PAD]."""
        return self._folder_tokenizer.pad_id if self._folder_tokenizer else PAD_ID

    def fit_batches(self, batches: Iterable[pa.Table]) -> None:
        if self._folder_tokenizer is None:
            super().fit_batches(batches)
        else:
            self.hf_tokenizer = self._folder_tokenizer

    def state(self) -> bytes:
        return self.hf_tokenizer.state() if self.hf_tokenizer else super().state()

    def load(self, state: bytes, source: str) -> None:
        document = saved_state(state)
        if document is None:
            self.hf_tokenizer = None
            super().load(state, source)
            pad = PAD_ID
        else:
            self.tokenizer = None
            self.hf_tokenizer = PretrainedTokenizer.from_state(document, self.params.seq_len, self._embeddings, source,
                                                               self.name)
            pad = self.hf_tokenizer.pad_id
        if pad != self.pad_id:
            raise FatalError(f"{source}: its tokenizer pads with id {pad}, the model with {self.pad_id} (the "
                             f"{'pretrained folder' if self._folder_tokenizer else 'trnflow'} tokenizer's); start "
                             "from a checkpoint made with this model.params.pretrained")

    def features(self, rows: pa.Table) -> torch.Tensor:
        if self.hf_tokenizer is None:
            return super().features(rows)
        return self.hf_tokenizer.encode(self._texts(rows))

    def example(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        if self._folder_tokenizer is None:
            return super().example(rows, generator)
        return torch.randint(0, self._folder_tokenizer.vocab_size, (rows, self.params.seq_len), generator=generator)

    def build_model(self) -> EncoderClassifier:
        encoder = self._model(transformers(self.name).AutoModel, {"pad_token_id": PAD_ID})
        meta = torch.get_default_device().type == "meta"  # counted, never run: no tokenizer fetched for its pad id
        model = EncoderClassifier(encoder, self.params.num_classes, PAD_ID if meta else self.pad_id)
        model.encoder = self._adapt(model.encoder)  # the head, new, trains whole
        return model

    def export(self, model: nn.Module, folder: Path) -> bool:
        """The trained model as `save_pretrained` writes it (the encoder: config.json and
        model.safetensors, which AutoModel.from_pretrained loads), beside the head's weights and the
        tokenizer (a pretrained one as its own save_pretrained writes it). With LoRA, the adapter alone
        in PEFT's format under `adapter/`, and the encoder merged with it in the folder."""
        assert isinstance(model, EncoderClassifier)
        if self.params.lora is not None:
            save_adapted(model.encoder, folder)
        else:
            model.encoder.save_pretrained(folder)
        torch.save(model.head.state_dict(), folder / "head.pt")
        if self.hf_tokenizer is not None:  # as AutoTokenizer.from_pretrained reads it
            self.hf_tokenizer.save(folder)
        else:
            (folder / FILE).write_bytes(self.state())
        (folder / "trnflow.json").write_text(self.describe().model_dump_json(indent=2))
        return True
