"""The evaluation phase: holdout accuracy and loss of a checkpoint, sharded across the cores."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trnflow.fsutil import atomic_write_json
from trnflow.gate import metrics_document
from trnflow.storage import local_path
from trnflow.workload.checkpoint import load_checkpoint, load_model_weights
from trnflow.workload.context import WorkerContext
from trnflow.workload.data import HashingTokenizer, load_labelled, static_batches
from trnflow.workload.model import build_model
from trnflow.workload.programs import for_run


def run(ctx: WorkerContext, checkpoint: str) -> dict:
    spec = ctx.spec
    cfg = spec.model
    source = local_path(checkpoint)
    ckpt = load_checkpoint(source)
    model = build_model(cfg, spec.train.seed)
    load_model_weights(model, ckpt.model, source)
    programs = for_run(ctx, model)

    holdout = load_labelled(spec.data.holdout, spec.data, HashingTokenizer(cfg.vocab_size, cfg.seq_len),
                            cfg.num_classes)
    assert holdout.labels is not None
    mine = torch.arange(ctx.rank, len(holdout.labels), ctx.world_size)
    totals = torch.zeros(3, dtype=torch.float64)  # correct, loss sum, rows
    offset = 0
    for batch, real in static_batches(holdout.tokens, mine, spec.inference.batch_size):
        logits = programs.logits(batch).float()[:real]
        labels = holdout.labels[mine[offset:offset + real]]
        offset += real
        totals[0] += (logits.argmax(-1) == labels).sum()
        totals[1] += F.cross_entropy(logits, labels, reduction="sum")
        totals[2] += real
    if ctx.world_size > 1:
        dist.all_reduce(totals)
    correct, loss_sum, rows = totals.tolist()
    point = {"step": ckpt.step, "accuracy": correct / rows, "loss": loss_sum / rows, "rows": int(rows)}
    ctx.log("evaluate", **point)
    if ctx.is_main and source.is_dir():  # the run's metric series, beside its checkpoints
        series = source.parent / "metrics.json"
        points = json.loads(series.read_text())["points"] if series.exists() else []
        points = [p for p in points if p["step"] != point["step"]] + [point]
        atomic_write_json(series, metrics_document(points, source=ckpt.meta.get("run_id", "trnflow")))
    return {"checkpoint": checkpoint, "points": [point], "compile": programs.compiler.summary()}
