"""Evaluation on the holdout set, sharded across the cores: during training every `gate.eval_every`
steps and at the end, or on its own for any checkpoint (the evaluate phase).

Each evaluation point has accuracy and the metrics the spec names. A run's points form its metric
series, `<run>/metrics.json` beside its checkpoints, which also keeps the final point's
per-example outcome (one character per holdout row, '1' when the prediction was right) and a
digest of the holdout, so that two runs on the same holdout can be compared example by example.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist

from trnflow.errors import FatalError
from trnflow.lifecycle.gate import SERIES, read_series, write_series
from trnflow.records import MetricPoint
from trnflow.results import EvaluateResult
from trnflow.storage.datafiles import data_files
from trnflow.workload.checkpoint import Checkpoint, load_checked, load_model_weights, on_base
from trnflow.workload.context import WorkerContext
from trnflow.workload.data import read_labelled
from trnflow.workload.programs import Programs, build_model, for_run
from trnflow.workload.recipes import Recipe, for_job
from trnflow.workload.sampler import static_batches

__all__ = ["SERIES", "Holdout", "featurized", "run", "write_series"]


def featurized(recipe: Recipe, ckpt: Checkpoint) -> Recipe:
    """`recipe` with the featurizer a checkpoint's weights were trained with."""
    if ckpt.featurizer is None:
        raise FatalError(f"{ckpt.url}: has no {recipe.featurizer_file} beside it; put the featurizer the weights "
                         "were trained with there")
    recipe.load(ckpt.featurizer, ckpt.url)
    return recipe


def loaded(ctx: WorkerContext, checkpoint: str) -> tuple[Recipe, Checkpoint, Programs]:
    """The spec's recipe, a checkpoint of it read, and the programs of its model with the
    checkpoint's weights: what evaluating or running inference with a checkpoint starts from."""
    recipe = for_job(ctx.spec)
    ckpt = load_checked(ctx, checkpoint, recipe.featurizer_file)  # a registered version's: as registered
    model = build_model(recipe, ctx.spec.train.seed)
    load_model_weights(model, ckpt.model, ckpt.url, on_base(ckpt, recipe.base()))
    return recipe, ckpt, for_run(ctx, recipe, model)


class Holdout:
    """The holdout set, featurized once; each replica evaluates every replicas-th row (the ranks of a
    tensor-parallel group evaluate the same rows together)."""

    def __init__(self, ctx: WorkerContext, recipe: Recipe):
        spec = ctx.spec
        rows = read_labelled(data_files(spec.data.holdout, spec.data.format), spec.data, recipe.columns(),
                             recipe.num_classes, spec.data.holdout)
        assert rows.labels is not None
        self.ctx, self.labels, self.recipe = ctx, rows.labels, recipe
        gate = spec.gate
        self.metrics = list(dict.fromkeys((gate.metric, *gate.metrics)))
        self.directions: dict[str, str] = {}
        """Which way each metric of a point is better, as its series records it (set by `evaluate`)."""
        self.tokens = recipe.features(rows.table)
        digest = hashlib.sha256()
        for line, label in zip(rows.lines(), rows.labels.tolist(), strict=True):
            digest.update(f"{label}\t{line}\n".encode())
        self.digest = digest.hexdigest()

    def evaluate(self, programs: Programs, step: int, global_step: int) -> tuple[MetricPoint, str | None]:
        """One evaluation point, and the per-example outcome as a string of '0' and '1' (None for a
        recipe whose outputs are not right or wrong)."""
        ctx, spec = self.ctx, self.ctx.spec
        mine = torch.arange(ctx.replica, len(self.labels), ctx.replicas)  # a tensor-parallel group's rows together
        logits = torch.zeros(len(self.labels), self.recipe.width, dtype=torch.float64)
        offset, batches = 0, 0
        for batch, real in static_batches(self.tokens, mine, spec.inference.batch_size):
            logits[mine[offset:offset + real]] = programs.logits(batch)[:real].double()
            offset, batches = offset + real, batches + 1
        if programs.fsdp:  # every rank gathers each block's weights: all run as many batches as the most
            rows = math.ceil(len(self.labels) / ctx.replicas)  # rank 0 has the most rows
            filler, _ = next(static_batches(self.tokens, torch.arange(1), spec.inference.batch_size))
            for _ in range(math.ceil(rows / spec.inference.batch_size) - batches):
                programs.logits(filler)
        if ctx.rank % ctx.tp:  # its group's first rank holds the same rows
            logits.zero_()
        if ctx.world_size > 1:  # each row was filled by one rank, and is zero on the others
            dist.all_reduce(logits)
        values = self.recipe.evaluate(logits, self.labels, self.metrics)
        self.directions = {name: self.recipe.direction(name) for name in values}
        point = MetricPoint(step=step, global_step=global_step, rows=len(self.labels), values=values)
        correct = self.recipe.outcomes(logits, self.labels)
        ctx.log("evaluate", step=step, global_step=global_step, rows=len(self.labels),
                **{k: round(v, 5) for k, v in values.items()})
        return point, correct


def run(ctx: WorkerContext, checkpoint: str) -> EvaluateResult:
    """Evaluate one checkpoint; a trnflow checkpoint's point joins its run's series."""
    recipe, ckpt, programs = loaded(ctx, checkpoint)
    holdout = Holdout(ctx, featurized(recipe, ckpt))
    global_step = ckpt.meta.global_step if ckpt.meta else ckpt.step
    point, correct = holdout.evaluate(programs, ckpt.step, global_step)
    series_url, outcome = None, correct
    run_url = ckpt.url.rpartition("/")[0]
    known = read_series(run_url) if ckpt.meta else None
    # a point joins the run's series only when it was measured on the series' own holdout
    if ctx.is_main and ckpt.meta and (known is None or known.holdout_sha256 in (None, holdout.digest)):
        points = [p for p in (known.points if known else []) if p.step != ckpt.step] + [point]
        newest = max(p.step for p in points)
        kept = known.predictions if known else None
        if ckpt.step < newest and kept is not None and kept.step == newest:  # keep the newest point's outcome
            correct, at = kept.correct, newest
        else:
            at = ckpt.step
        series_url = write_series(run_url, ckpt.meta.run_id, points, holdout.digest, at, correct, holdout.directions)
    return EvaluateResult(checkpoint=checkpoint, points=[point], series=series_url, holdout_sha256=holdout.digest,
                          correct=outcome, directions=holdout.directions, compile=programs.compiler.metrics())
