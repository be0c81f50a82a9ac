"""The programs a job runs on a core, each with static shapes: what ahead-of-time compilation
extracts and compiles.

- `train_step`: forward and loss on one per-core training batch (and its backward);
- `eval_step`: logits for one evaluation batch;
- `embed_step`: embeddings for one inference batch.

Evaluation and inference pad their last batch (see `data.static_batches`), so these three shapes
are all a run ever sees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from jobspecs import JobSpec
from trnflow.workload.model import TextEncoderClassifier


@dataclass
class Program:
    name: str
    fn: Callable[..., torch.Tensor]
    example: tuple[torch.Tensor, ...]
    training: bool
    """Train mode, and compiled with its backward pass."""

    def prepare(self, model: torch.nn.Module) -> None:
        model.train(self.training)


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()


def programs(spec: JobSpec, model: TextEncoderClassifier) -> list[Program]:
    cfg, precision = spec.model, spec.compute.precision
    gen = torch.Generator().manual_seed(0)
    batch, infer_batch = spec.per_core_batch, spec.inference.batch_size
    tokens = torch.randint(2, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    labels = torch.randint(0, cfg.num_classes, (batch,), generator=gen)
    infer_tokens = torch.randint(2, cfg.vocab_size, (infer_batch, cfg.seq_len), generator=gen)

    def train_step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _autocast(precision):
            logits = model(tokens)
        return F.cross_entropy(logits.float(), labels)

    def eval_step(tokens: torch.Tensor) -> torch.Tensor:
        return model(tokens)

    def embed_step(tokens: torch.Tensor) -> torch.Tensor:
        return model.embed(tokens)

    return [
        Program("train_step", train_step, (tokens, labels), training=True),
        Program("eval_step", eval_step, (infer_tokens,), training=False),
        Program("embed_step", embed_step, (infer_tokens,), training=False),
    ]
