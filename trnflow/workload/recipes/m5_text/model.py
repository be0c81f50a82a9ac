"""The M5-style model: a transformer text encoder followed by an MLP head.

A plain `nn.Module`: its `state_dict` loads in any PyTorch program that builds the same shapes.
"""

from __future__ import annotations

import torch
from torch import nn

from trnflow.workload.recipes.m5_text.params import PAD_ID, M5TextParams


class TextEncoderClassifier(nn.Module):
    def __init__(self, cfg: M5TextParams):
        super().__init__()
        self.cfg = cfg
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=PAD_ID)
        self.positions = nn.Embedding(cfg.seq_len, cfg.d_model)
        block = nn.TransformerEncoderLayer(
            cfg.d_model, cfg.n_heads, cfg.ffn_dim, cfg.dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(block, cfg.n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(cfg.d_model)
        layers: list[nn.Module] = []
        width = cfg.d_model
        for hidden in cfg.mlp_hidden:
            layers += [nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(cfg.dropout)]
            width = hidden
        layers.append(nn.Linear(width, cfg.num_classes))
        self.head = nn.Sequential(*layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The text embedding: encoder output mean-pooled over real tokens, then layer-normed."""
        keep = tokens != PAD_ID
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        x = self.encoder(x, src_key_padding_mask=~keep)
        weights = keep.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        return self.norm(pooled)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))
