"""The preflight's checkpoint round trip: before anything trains, a checkpoint of the spec's real
model and optimizer shapes is written where the run's checkpoints go, read back, compared and
deleted.

A checkpoint location that cannot be written (no access, a bucket that is not there, a full disk,
a store that returns what it was not given) otherwise shows itself at the first save, an interval
into training, when the instances have been billed for it. The round trip goes through the same
code as every checkpoint (its files, then the commit marker with their checksums; read back with
`weights_only`), under `<checkpoint_url>/<run id>/_preflight/`, which resuming never looks at (and
which no run id may be named: the preflight's IAM role may write only there).
"""

from __future__ import annotations

import time

import torch

from trnflow.errors import FatalError
from trnflow.records import CheckpointMeta, DataRead
from trnflow.storage import join
from trnflow.workload import PREFLIGHT_FOLDER, watchdog
from trnflow.workload.checkpoint import RunCheckpoints, load, trainable, trained_state, weights_digest
from trnflow.workload.context import WorkerContext
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import for_job


def _flat(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _flat(tree[key])]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _flat(item)]
    return []


def round_trip(ctx: WorkerContext, run_id: str) -> dict:
    """Write, read back, compare and delete one checkpoint of the spec's model and its optimizer's
    state (rank 0 alone); what it wrote and how long each way took. FatalError names the location
    and what failed."""
    spec = ctx.spec
    recipe = for_job(spec)
    url = join(spec.train.checkpoint_url, run_id, PREFLIGHT_FOLDER)
    with torch.random.fork_rng(devices=[]):  # the run's random streams are not this check's
        model = build_model(recipe, spec.train.seed)
        optimizer = recipe.optimizer(trainable(model), spec.train)
        for p in trainable(model):
            p.grad = torch.zeros_like(p)
        optimizer.step()  # its state, of every weight's shape
    meta = CheckpointMeta(run_id=run_id, step=0, global_step=0, spec_digest=spec.digest(),
                          precision=spec.compute.precision, world_size=ctx.world_size, sampler={}, data=DataRead(),
                          recipe=recipe.describe(), torch=torch.__version__, base=recipe.base())
    checkpoints = RunCheckpoints(url)
    weights, state = trained_state(model), optimizer.state_dict()
    began = time.perf_counter()
    try:
        with watchdog.busy("the preflight's checkpoint round trip"):  # a large model takes a while each way
            saved = checkpoints.save(0, weights, state, [], (recipe.featurizer_file, b"{}"), meta)
            wrote = time.perf_counter() - began
            back = load(saved, recipe.featurizer_file)
            read = time.perf_counter() - began - wrote
    except Exception as exc:
        raise FatalError(f"train.checkpoint_url: the preflight could not write a checkpoint to {url} and read it "
                         f"back ({type(exc).__name__}: {exc}); the run would fail at its first checkpoint. Check the "
                         "location and this job's write access to it (preflight.checkpoint_round_trip: false skips "
                         "this check)") from None
    finally:
        left = _clean(checkpoints, url)
    if left:  # written and read, but not deleted: the run can checkpoint; say what is left
        ctx.log("warning", message=left)
    theirs, ours = _flat(back.optim), _flat(state)
    same = weights_digest(back.model) == weights_digest(weights) and len(theirs) == len(ours) and all(
        torch.equal(a, b) for a, b in zip(theirs, ours, strict=True))
    if not same:
        raise FatalError(f"train.checkpoint_url: a checkpoint written to {url} read back different from what was "
                         "written; the store there does not keep what it is given")
    size = sum(t.numel() * t.element_size() for t in _flat(weights) + _flat(state))
    return {"url": url, "bytes": size, "write_seconds": round(wrote, 3), "read_seconds": round(read, 3),
            "passed": True, **({"left": left} if left else {})}


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
