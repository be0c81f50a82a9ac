"""The preflight's checkpoint round trip: before anything trains, a checkpoint of the spec's real
model and optimizer shapes is written where the run's checkpoints go, read back, compared and
deleted.

A checkpoint location that cannot be written (no access, a bucket that is not there, a full disk,
a store that returns what it was not given) otherwise shows itself at the first save, an interval
into training, when the instances have been billed for it. The round trip goes through the same
code as every checkpoint (its files, then the commit marker with their checksums; read back with
`weights_only`), under `<checkpoint_url>/<run id>/_preflight/`, which resuming never looks at (and
which no run id may be named: the preflight's IAM role may write only there).

A run whose checkpoints are sharded (fsdp, or layers split over cores: tp > 1) rehearses them as
it will write them: every rank spreads the model over the run's mesh and stores its own shard, rank
0 commits the folder, and every rank loads the shards back into a fresh spread model and compares
its part. Otherwise rank 0 writes the whole checkpoint alone.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.tensor import DTensor

from trnflow.errors import FatalError
from trnflow.records import CheckpointMeta, DataRead
from trnflow.results import CheckpointRoundTrip
from trnflow.storage import join
from trnflow.workload import PREFLIGHT_FOLDER, watchdog
from trnflow.workload.checkpoint import RunCheckpoints, load, trainable, trained_state, weights_digest
from trnflow.workload.context import WorkerContext, barrier, gather_objects
from trnflow.workload.programs import build_model, spread
from trnflow.workload.recipes import Recipe, for_job
from trnflow.workload.sharding import load_shards, save_shards

T = TypeVar("T")


def _flat(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, DTensor):
        return [tree.to_local()]  # this rank's part
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _flat(tree[key])]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _flat(item)]
    return []


def _same(a: object, b: object) -> bool:
    theirs, ours = _flat(a), _flat(b)
    return len(theirs) == len(ours) and all(torch.equal(x, y) for x, y in zip(theirs, ours, strict=True))


class _Failed(Exception):
    """One rank's part of the round trip failed (every rank raises it, with the first rank's error)."""


def _on_every_rank(ctx: WorkerContext, fn: Callable[[], T]) -> T:
    """`fn()` on this rank; when it fails on any rank, every rank raises _Failed with the first error,
    so that none waits in a later collective for a rank that gave up."""
    try:
        out, error = fn(), None
    except Exception as exc:
        out, error = None, f"{type(exc).__name__}: {exc}"
    errors = [e for e in gather_objects(ctx, error) if e]
    if errors:
        raise _Failed(errors[0])
    return out  # type: ignore[return-value]  # None only when it failed


def _built(ctx: WorkerContext, recipe: Recipe, fsdp: bool, sharded: bool, stepped: bool = True
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The spec's model, spread as training spreads it when `sharded`, and its optimizer, after one
    step when `stepped` (its state then holds a tensor of every weight's shape)."""
    spec = ctx.spec
    model = build_model(recipe, spec.train.seed).to(ctx.device.torch_device)
    if sharded:
        spread(spec, recipe, model, ctx.device, fsdp)
    optimizer = recipe.optimizer(trainable(model), spec.train)
    if stepped:
        for p in trainable(model):
            p.grad = torch.zeros_like(p)
        optimizer.step()
    return model, optimizer


def round_trip(ctx: WorkerContext, run_id: str) -> CheckpointRoundTrip | None:
    """Write, read back, compare and delete one checkpoint of the spec's model and its optimizer's
    state, laid out as the run's will be; what it wrote and how long each way took, on rank 0 (None
    on the others). Every rank calls it. FatalError names the location and what failed."""
    spec = ctx.spec
    recipe = for_job(spec)
    fsdp = spec.layout.strategy == "fsdp"
    sharded = fsdp or ctx.tp > 1
    if not sharded and not ctx.is_main:
        return None
    url = join(spec.train.checkpoint_url, run_id, PREFLIGHT_FOLDER)
    checkpoints = RunCheckpoints(url)
    meta = CheckpointMeta(run_id=run_id, step=0, global_step=0, spec_digest=spec.digest(),
                          precision=spec.compute.precision, world_size=ctx.world_size, sampler={}, data=DataRead(),
                          recipe=recipe.describe(), torch=torch.__version__, base=recipe.base(),
                          parallelism="fsdp" if fsdp else "ddp", tp=ctx.tp)
    trip = _Trip(ctx, recipe, checkpoints, meta)
    try:
        # a large model takes a while each way; the run's random streams are not this check's
        with watchdog.busy("the preflight's checkpoint round trip"), torch.random.fork_rng(devices=[]):
            same = trip.sharded(fsdp) if sharded else trip.whole()
    except Exception as exc:  # a sharded trip's ranks all raise _Failed at the same point (_on_every_rank)
        left = _clean(checkpoints, url) if ctx.is_main else None
        why = str(exc) if isinstance(exc, _Failed) else f"{type(exc).__name__}: {exc}"
        raise FatalError(f"train.checkpoint_url: the preflight could not write a checkpoint to {url} and read it "
                         f"back ({why}); the run would fail at its first checkpoint. Check the location and this "
                         "job's write access to it (preflight.checkpoint_round_trip: false skips this check)"
                         + (f". {left}" if left else "")) from None
    if sharded:
        barrier(ctx)  # every rank has read the shards before rank 0 deletes them
    if not ctx.is_main:
        return None
    left = _clean(checkpoints, url)
    if left:  # written and read, but not deleted: the run can checkpoint; say what is left
        ctx.log("warning", message=left)
    if not same:
        raise FatalError(f"train.checkpoint_url: a checkpoint written to {url} read back different from what was "
                         "written; the store there does not keep what it is given")
    return CheckpointRoundTrip(url=url, bytes=trip.bytes, write_seconds=round(trip.wrote, 3),
                               read_seconds=round(trip.read, 3), layout="sharded" if sharded else "whole",
                               ranks=ctx.world_size if sharded else 1, passed=True, left=left)


class _Trip:
    """One round trip's writing and reading back; `bytes`, `wrote` and `read` once done."""

    def __init__(self, ctx: WorkerContext, recipe: Recipe, checkpoints: RunCheckpoints, meta: CheckpointMeta):
        self.ctx, self.recipe, self.checkpoints, self.meta = ctx, recipe, checkpoints, meta
        self.featurizer = (recipe.featurizer_file, b"{}")
        self.bytes, self.wrote, self.read = 0, 0.0, 0.0

    def whole(self) -> bool:
        """Rank 0 alone: the model and optimizer state whole, as a ddp run's checkpoints."""
        model, optimizer = _built(self.ctx, self.recipe, fsdp=False, sharded=False)
        weights, state = trained_state(model), optimizer.state_dict()
        began = time.perf_counter()
        saved = self.checkpoints.save(0, weights, state, [], self.featurizer, self.meta)
        self.wrote = time.perf_counter() - began
        back = load(saved, self.recipe.featurizer_file)
        self.read = time.perf_counter() - began - self.wrote
        self.bytes = sum(t.numel() * t.element_size() for t in _flat(weights) + _flat(state))
        return weights_digest(back.model) == weights_digest(weights) and _same(back.optim, state)

    def sharded(self, fsdp: bool) -> bool:
        """Every rank: its shard stored as training stores it, the folder committed by rank 0, then
        the shards loaded into a fresh model spread alike, each rank comparing its part."""
        ctx, checkpoints = self.ctx, self.checkpoints
        model, optimizer = _built(ctx, self.recipe, fsdp, sharded=True)
        began = time.perf_counter()
        _on_every_rank(ctx, lambda: checkpoints.clear(0) if ctx.is_main else None)
        with tempfile.TemporaryDirectory(prefix="trnflow-shards-") as tmp:
            files = save_shards(model, optimizer, Path(tmp))  # a collective
        listed = _on_every_rank(ctx, lambda: checkpoints.write_shards(0, files))
        shards = {name: digest for part in gather_objects(ctx, listed) for name, digest in part.items()}
        saved = gather_objects(ctx, _on_every_rank(ctx, lambda: checkpoints.save(
            0, None, None, [], self.featurizer, self.meta, shards=shards) if ctx.is_main else None))[0]
        self.wrote = time.perf_counter() - began
        back = _on_every_rank(ctx, lambda: load(saved, self.recipe.featurizer_file))
        fresh, fresh_optimizer = _built(ctx, self.recipe, fsdp, sharded=True, stepped=False)
        _on_every_rank(ctx, lambda: load_shards(fresh, fresh_optimizer, back.shards or {}))
        self.read = time.perf_counter() - began - self.wrote
        mine = _same(trained_state(fresh), trained_state(model)) and _same(fresh_optimizer.state_dict(),
                                                                           optimizer.state_dict())
        self.bytes = sum(d["size"] for d in shards.values())
        return all(gather_objects(ctx, mine))


def _clean(checkpoints: RunCheckpoints, url: str) -> str | None:
    """Delete the round trip's checkpoint; what could not be deleted, or None. A failure here never
    hides the round trip's own."""
    try:
        checkpoints.store.delete_prefix("")
        if any(True for _ in checkpoints.store.list("")):
            return f"the preflight's checkpoint under {url} could not all be deleted; delete it by hand"
    except Exception as exc:  # a store that takes writes but refuses deletes
        return f"the preflight's checkpoint under {url} could not be deleted ({type(exc).__name__}: {exc})"
    return None
