"""The tokenizer: byte-pair encoding (BPE), trained on the training corpus, saved beside every checkpoint.

An incremental run reuses its parent's tokenizer, so a word keeps its id across runs and the
embedding rows learned for it stay meaningful. Ids 0, 1 and 2 are always [PAD], [CLS] and [UNK];
every sequence starts with [CLS] and is padded or cut to the spec's fixed length.

BPE rather than WordPiece: the `tokenizers` WordPiece trainer breaks ties between equally frequent
merges differently from run to run, and two runs on the same data must get the same vocabulary.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import pyarrow as pa

from trnflow.errors import FatalError
from trnflow.workload.recipes.base import Recipe
from trnflow.workload.recipes.m5_text.params import CLS_ID, PAD_ID

if TYPE_CHECKING:
    import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # worker processes are forked per core

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

SPECIAL = ["[PAD]", "[CLS]", "[UNK]"]
FILE = "tokenizer.json"


class TextTokenizer:
    """Text to fixed-shape id tensors."""

    def __init__(self, tokenizer: Tokenizer, seq_len: int):
        if tokenizer.token_to_id("[PAD]") != PAD_ID or tokenizer.token_to_id("[CLS]") != CLS_ID:
            raise FatalError("the tokenizer does not map [PAD] to 0 and [CLS] to 1; it was not made by trnflow")
        tokenizer.enable_truncation(max_length=seq_len)
        tokenizer.enable_padding(length=seq_len, pad_id=PAD_ID, pad_token=SPECIAL[0])
        self.tokenizer, self.seq_len = tokenizer, seq_len

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, texts: list[str]) -> torch.Tensor:
        import torch  # torch (~1 s): only where rows become tensors, never for a spec check

        encodings = self.tokenizer.encode_batch([t or "" for t in texts])
        return torch.tensor([e.ids for e in encodings], dtype=torch.long).reshape(len(texts), self.seq_len)

    def to_json(self) -> str:
        return self.tokenizer.to_str()

    @classmethod
    def from_json(cls, text: str, seq_len: int, vocab_limit: int, source: str) -> TextTokenizer:
        try:
            tokenizer = Tokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises its own exception type
            raise FatalError(f"{source}: not a tokenizer file ({exc}); remove it or train from scratch") from None
        if tokenizer.get_vocab_size() > vocab_limit:
            raise FatalError(
                f"{source}: the tokenizer has {tokenizer.get_vocab_size()} tokens but model.params.vocab_size is "
                f"{vocab_limit}; raise model.params.vocab_size to at least that"
            )
        return cls(tokenizer, seq_len)


def train_tokenizer(texts: Iterable[str], vocab_size: int, seq_len: int) -> TextTokenizer:
    """A BPE vocabulary of at most `vocab_size` tokens learned from `texts`; the same texts always
    give the same vocabulary."""
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL[2]))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", CLS_ID)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return TextTokenizer(tokenizer, seq_len)


class BpeTextRecipe(Recipe):
    """The featurizer half of a recipe that reads text: a BPE tokenizer trained on the first run's
    texts (`data.text_field`) and saved as `tokenizer.json`, every text padded or cut to
    `params.seq_len`. Its params have `vocab_size`, `seq_len` and `num_classes`."""

    featurizer_file = FILE
    tokenizer: TextTokenizer | None = None

    @property
    def num_classes(self) -> int:
        return self.params.num_classes

    def columns(self) -> list[str]:
        return [self.data.text_field]

    def fit(self, rows: pa.Table) -> None:
        self.fit_batches([rows])

    def fit_batches(self, batches: Iterable[pa.Table]) -> None:
        texts = (text for rows in batches for text in self._texts(rows))
        self.tokenizer = train_tokenizer(texts, self.params.vocab_size, self.params.seq_len)

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
        import torch  # torch (~1 s): only where rows become tensors, never for a spec check

        return torch.randint(2, self.params.vocab_size, (rows, self.params.seq_len), generator=generator)

    def _texts(self, rows: pa.Table) -> list[str]:
        return [str(t) for t in rows.column(self.data.text_field).to_pylist()]
