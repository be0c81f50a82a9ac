"""`m5-text`: the M5-style text classifier, trnflow's built-in recipe. A transformer encoder over
byte-pair-encoded text, mean-pooled into the published embedding, then an MLP head.

Its featurizer is the tokenizer (`tokenizer.json`), trained on the first run's corpus and reused by
every run trained further from it, so a word keeps its id; texts are padded or cut to `seq_len`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trnflow.errors import FieldError
from trnflow.workload.recipes.m5_text.params import M5TextParams
from trnflow.workload.recipes.m5_text.tokenizer import BpeTextRecipe

if TYPE_CHECKING:
    from torch import nn

    from trnflow.device.layout import TensorPlan
    from trnflow.workload.recipes.m5_text.model import TextEncoderClassifier


class M5Text(BpeTextRecipe):
    name = "m5-text"
    version = "1"
    Params = M5TextParams
    params: M5TextParams

    def build_model(self) -> TextEncoderClassifier:
        from trnflow.workload.recipes.m5_text.model import TextEncoderClassifier  # torch: for a network only

        return TextEncoderClassifier(self.params)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.encoder.layers)  # type: ignore[union-attr]

    def tensor_plan(self, model: nn.Module, tp: int) -> TensorPlan:
        raise FieldError("train.parallelism.tp", "m5-text does not split its layers: its encoder is PyTorch's "
                         "fused nn.TransformerEncoderLayer, whose attention keeps query, key and value in one "
                         "weight, and the model is small enough for one core; use tp: 1 (fsdp shards it if needed)")

    def activation_bytes(self, batch: int, value_bytes: int) -> int:
        p = self.params
        seq, d, f, h = p.seq_len, p.d_model, p.ffn_dim, p.n_heads
        per_layer = batch * seq * (6 * d + 2 * f) + 2 * batch * h * seq * seq  # projections, FFN, scores + softmax
        return (p.n_layers * per_layer + 2 * batch * seq * d) * value_bytes
