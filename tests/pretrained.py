"""Tiny pretrained models and tokenizers, made with `transformers` and saved with `save_pretrained`,
as a user's pretrained folder would be (the tests download nothing)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

ENCODER_SPECIAL = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
"""The encoder's tokenizer's special tokens: [PAD] is id 3, not trnflow's own 0."""


def tiny_encoder(folder: Path, texts: Iterable[str], vocab_size: int = 400) -> Path:
    """A one-layer BERT and a WordPiece tokenizer of its own (learned from `texts`), saved in `folder`."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import AutoModel, BertConfig, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=ENCODER_SPECIAL,
                                                                 show_progress=False))
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", cls_token="[CLS]",
                                        sep_token="[SEP]", pad_token="[PAD]", mask_token="[MASK]")
    torch.manual_seed(5)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id)
    AutoModel.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
