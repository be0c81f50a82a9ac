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
        return self.recomputed_bytes(batch, value_bytes, "none")

    def recomputed_bytes(self, batch: int, value_bytes: int, setting: str, tp: int = 1) -> int:
        """Per layer: its projections and FFN (the matrix products' outputs: 5d + f a token), their
        inputs' normalizations and activation (d + f), and the attention's scores and softmax (h x
        seq a token, each); selective keeps the products' outputs and scores, full a layer's input
        (d a token) and one layer's whole while it is recomputed."""
        p = self.params
        seq, d, f, h = p.seq_len, p.d_model, p.ffn_dim, p.n_heads
        products = batch * seq * (5 * d + f) + batch * h * seq * seq
        per_layer = products + batch * seq * (d + f) + batch * h * seq * seq
        kept = {"none": p.n_layers * per_layer, "selective": p.n_layers * products,
                "full": p.n_layers * batch * seq * d + per_layer}[setting]
        return (kept + 2 * batch * seq * d) * value_bytes
