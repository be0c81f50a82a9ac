"""Evaluation on the holdout set, sharded across the cores: during training every `gate.eval_every`
steps and at the end, or on its own for any checkpoint (the evaluate phase).

Each evaluation point has accuracy and the metrics the spec names. A run's points form its metric
series, `<run>/metrics.json` beside its checkpoints, which also keeps the final point's
per-example outcome (one character per holdout row, '1' when the prediction was right) and a
digest of the holdout, so that two runs on the same holdout can be compared example by example.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from trnflow.errors import FatalError
from trnflow.lifecycle.gate import SERIES, read_series, write_series
from trnflow.storage.datafiles import data_files
from trnflow.workload.checkpoint import Checkpoint, load, load_model_weights
from trnflow.workload.context import WorkerContext
from trnflow.workload.data import read_labelled, static_batches
from trnflow.workload.metrics import classification_metrics
from trnflow.workload.model import build_model
from trnflow.workload.programs import Programs, for_run
from trnflow.workload.tokenizer import TextTokenizer

__all__ = ["SERIES", "Holdout", "run", "tokenizer_of", "write_series"]


def tokenizer_of(ckpt: Checkpoint, spec) -> TextTokenizer:
    """The tokenizer a checkpoint's token ids come from."""
    if ckpt.tokenizer is None:
        raise FatalError(f"{ckpt.url}: has no tokenizer.json beside it; put the tokenizer the weights were "
                         "trained with there")
    return TextTokenizer.from_json(ckpt.tokenizer, spec.model.seq_len, spec.model.vocab_size, ckpt.url)


class Holdout:
    """The holdout set, tokenized once; each rank evaluates every world-th row."""

    def __init__(self, ctx: WorkerContext, tokenizer: TextTokenizer):
        spec = ctx.spec
        texts = read_labelled(data_files(spec.data.holdout, spec.data.format), spec.data, spec.model.num_classes,
                              spec.data.holdout)
        assert texts.labels is not None
        self.ctx, self.labels = ctx, texts.labels
        self.tokens = tokenizer.encode(texts.texts)
        digest = hashlib.sha256()
        for text, label in zip(texts.texts, texts.labels.tolist(), strict=True):
            digest.update(f"{label}\t{text}\n".encode())
        self.digest = digest.hexdigest()

    def evaluate(self, programs: Programs, step: int, global_step: int) -> tuple[dict, str]:
        """One evaluation point, and the per-example outcome as a string of '0' and '1'."""
        ctx, spec = self.ctx, self.ctx.spec
        mine = torch.arange(ctx.rank, len(self.labels), ctx.world_size)
        logits = torch.zeros(len(self.labels), spec.model.num_classes, dtype=torch.float64)
        offset = 0
        for batch, real in static_batches(self.tokens, mine, spec.inference.batch_size):
            logits[mine[offset:offset + real]] = programs.logits(batch)[:real].double()
            offset += real
        if ctx.world_size > 1:  # each row was filled by one rank, and is zero on the others
            dist.all_reduce(logits)
        values = classification_metrics(logits, self.labels, list(spec.gate.metrics))
        point = {"step": step, "global_step": global_step, **values, "rows": len(self.labels)}
        correct = "".join("1" if ok else "0" for ok in (logits.argmax(-1) == self.labels).tolist())
        ctx.log("evaluate", **{k: round(v, 5) if isinstance(v, float) else v for k, v in point.items()})
        return point, correct


def run(ctx: WorkerContext, checkpoint: str) -> dict:
    """Evaluate one checkpoint; a trnflow checkpoint's point joins its run's series."""
    spec = ctx.spec
    ckpt = load(checkpoint)
    model = build_model(spec.model, spec.train.seed)
    load_model_weights(model, ckpt.model, ckpt.url)
    programs = for_run(ctx, model)
    holdout = Holdout(ctx, tokenizer_of(ckpt, spec))
    global_step = int(ckpt.meta.get("global_step", ckpt.step))
    point, correct = holdout.evaluate(programs, ckpt.step, global_step)
    series_url = None
    if ctx.is_main and not ckpt.meta.get("plain_state_dict"):
        run_url = ckpt.url.rpartition("/")[0]
        known = read_series(run_url) or {}
        points = [p for p in known.get("points", []) if p["step"] != ckpt.step] + [point]
        newest = max(p["step"] for p in points)
        kept = known.get("predictions") or {}
        if ckpt.step < newest and kept.get("step") == newest:  # keep the newest point's per-example outcome
            correct, at = kept["correct"], newest
        else:
            at = ckpt.step
        series_url = write_series(run_url, ckpt.meta.get("run_id", "trnflow"), points, holdout.digest, at, correct)
    return {"checkpoint": checkpoint, "points": [point], "series": series_url, "holdout_sha256": holdout.digest,
            "compile": programs.compiler.metrics().model_dump()}
