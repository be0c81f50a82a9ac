"""`m5-text`: the M5-style text classifier, trnflow's built-in recipe. A transformer encoder over
byte-pair-encoded text, mean-pooled into the published embedding, then an MLP head.

Its featurizer is the tokenizer (`tokenizer.json`), trained on the first run's corpus and reused by
every run trained further from it, so a word keeps its id; texts are padded or cut to `seq_len`.
"""

from __future__ import annotations

import pyarrow as pa
import torch

from trnflow.errors import FatalError
from trnflow.workload.recipes.base import Recipe
from trnflow.workload.recipes.m5_text.model import TextEncoderClassifier
from trnflow.workload.recipes.m5_text.params import M5TextParams
from trnflow.workload.recipes.m5_text.tokenizer import FILE, TextTokenizer, train_tokenizer


class M5Text(Recipe):
    name = "m5-text"
    version = "1"
    Params = M5TextParams
    featurizer_file = FILE
    params: M5TextParams
    tokenizer: TextTokenizer | None = None

    @property
    def num_classes(self) -> int:
        return self.params.num_classes

    def columns(self) -> list[str]:
        return [self.data.text_field]

    def fit(self, rows: pa.Table) -> None:
        self.tokenizer = train_tokenizer(self._texts(rows), self.params.vocab_size, self.params.seq_len)

    def state(self) -> bytes:
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        return self.tokenizer.to_json().encode()

    def load(self, state: bytes, source: str) -> None:
        try:
            text = state.decode()
        except UnicodeDecodeError:
            raise FatalError(f"{source}: its {FILE} is not UTF-8 text; the file is damaged, use an earlier "
                             "checkpoint") from None
        self.tokenizer = TextTokenizer.from_json(text, self.params.seq_len, self.params.vocab_size, source)

    def features(self, rows: pa.Table) -> torch.Tensor:
        assert self.tokenizer is not None, "fit or load the tokenizer first"
        return self.tokenizer.encode(self._texts(rows))

    def example(self, rows: int, generator: torch.Generator) -> torch.Tensor:
        return torch.randint(2, self.params.vocab_size, (rows, self.params.seq_len), generator=generator)

    def build_model(self) -> TextEncoderClassifier:
        return TextEncoderClassifier(self.params)

    def activation_bytes(self, batch: int, value_bytes: int) -> int:
        p = self.params
        seq, d, f, h = p.seq_len, p.d_model, p.ffn_dim, p.n_heads
        per_layer = batch * seq * (6 * d + 2 * f) + 2 * batch * h * seq * seq  # projections, FFN, scores + softmax
        return (p.n_layers * per_layer + 2 * batch * seq * d) * value_bytes

    def _texts(self, rows: pa.Table) -> list[str]:
        return [str(t) for t in rows.column(self.data.text_field).to_pylist()]
