"""The settings of the `m5-text` recipe (`model.params` in a spec)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

PAD_ID = 0
"""The tokenizer's padding id, which the model masks out."""
CLS_ID = 1
"""The id of the token the tokenizer puts first."""


class M5TextParams(BaseModel):
    """The text encoder and its head."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(8192, ge=256, le=1_000_000, description="Token vocabulary size.")
    d_model: int = Field(128, ge=8, le=8192, description="Width of the encoder (embedding size).")
    n_heads: int = Field(4, ge=1, le=128, description="Attention heads per encoder block.")
    n_layers: int = Field(2, ge=1, le=96, description="Number of transformer encoder blocks.")
    ffn_dim: int = Field(512, ge=8, le=65536, description="Hidden size of each block's feed-forward layer.")
    mlp_hidden: list[int] = Field(default_factory=lambda: [64],
                                  description="Hidden layer sizes of the MLP head, in order.")
    num_classes: int = Field(2, ge=2, le=100_000, description="Number of output classes.")
    seq_len: int = Field(64, ge=4, le=32768, description="Fixed sequence length: texts are padded or cut.")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout probability in encoder and head.")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> M5TextParams:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model: {self.d_model} is not divisible by n_heads ({self.n_heads}); "
                             "pick a width that is a multiple of the head count")
        if any(h < 1 for h in self.mlp_hidden):
            raise ValueError("mlp_hidden: every layer size must be >= 1")
        return self
