"""The device-memory budget of one NeuronCore: estimated before launch, measured during a run.

The estimate counts what a training step keeps on each core of the real device: weights,
gradients, the optimizer's state (AdamW's two moments, or whatever the recipe's optimizer keeps per
weight) and the activations saved for the backward pass, in the spec's precision. Data-parallel
training (`ddp`) keeps all of the first three on every core; sharded training (`fsdp`) keeps 1/N of
them and gathers the weights of one block (and the next, prefetched) whole while it computes. The
plan holds both, and `auto` takes ddp when it fits. A job whose estimate exceeds the instance's
memory per core is refused before it starts. (The emulator itself holds pure-bf16 state in fp32
tensors whose values lie on the bf16 grid, so what a run measures for bf16-sr or bf16-rne is about
twice the device estimate.)
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from pydantic import ValidationError
from torch.distributed.tensor import DTensor

from trnflow.errors import FatalError, FieldError
from trnflow.measures import MemoryFigures, byte_size
from trnflow.specs import JobSpec, Layout, instance
from trnflow.specs.instances import TRAINING_TYPES
from trnflow.workload.recipes import Recipe, for_job

GIB = 1024**3


REHEARSAL_CORE_ENV = "TRNFLOW_REHEARSE_CORE_GIB"
"""Rehearsal only, never in production: the emulator models NeuronCores with this much device memory
(GiB) instead of the instance's, so that a model the size of the quickstart's is too big for one core
and `auto` shards it. Every estimate made under it says so."""
REHEARSAL_HOST_ENV = "TRNFLOW_REHEARSE_HOST_GIB"
"""Rehearsal only: the emulator models each instance's host with this much memory (GiB), as
`REHEARSAL_CORE_ENV` does its cores."""
MAX_SUGGESTED_NODES = 64
"""The most nodes a refusal's suggestion considers."""


def _rehearsed(env: str, what: str, example: str, most: float) -> int | None:
    value = os.environ.get(env, "").strip()
    if not value:
        return None
    try:
        gib = float(value)
    except ValueError:
        raise FatalError(f"{env}: {value!r} is not a number of GiB; unset it, or give e.g. {example}") from None
    if not 0 < gib <= most:
        raise FatalError(f"{env}: {value} GiB is not {what}; unset it, or give e.g. {example}")
    return int(gib * GIB)


def rehearsal_core_bytes() -> int | None:
    """The rehearsal's core memory (TRNFLOW_REHEARSE_CORE_GIB), or None when not rehearsing."""
    return _rehearsed(REHEARSAL_CORE_ENV, "a core's memory", "0.004", 1024)


def staging_limit(itype: str) -> tuple[int, bool]:
    """The host memory checkpoints written in the background may take on one `itype` instance: half
    of its memory (the rest is its ranks' own, their data's and the page cache's), or of the
    rehearsal's (TRNFLOW_REHEARSE_HOST_GIB) when smaller; and whether it is the rehearsal's."""
    real = instance(itype).host_memory_gib * GIB
    rehearsed = _rehearsed(REHEARSAL_HOST_ENV, "a host's memory", "0.5", 65536)
    return (real // 2, False) if rehearsed is None or rehearsed >= real else (rehearsed // 2, True)


def staged_per_node(spec: JobSpec, figures: MemoryFigures) -> int:
    """About the host memory one node's checkpoint written in the background is copied into (0 when
    they are written in step): the trained weights and optimizer state of rank 0 (whole
    checkpoints), or of every rank (sharded ones: each its shard)."""
    if not spec.train.checkpoint_async:
        return 0
    trained = figures.gradients + figures.optimizer  # a rank's trained weights are its gradients' size
    if figures.strategy == "ddp" and figures.tp == 1:
        return trained
    return trained * spec.compute.cores_per_node


def core_limit(itype: str) -> int:
    """The device memory one core of `itype` has, or the rehearsal's when smaller."""
    real = instance(itype).core_memory_bytes
    rehearsed = rehearsal_core_bytes()
    return real if rehearsed is None else min(real, rehearsed)


def parameter_count(recipe: Recipe) -> int:
    """Exact, without allocating: the model is built on the meta device."""
    return _shape(recipe).total


@functools.lru_cache(maxsize=8)
def _meta_model(recipe: Recipe) -> torch.nn.Module:
    """The recipe's model on the meta device: its shapes, without memory. Built once per recipe: a
    plan estimates many instance types, core counts and layouts."""
    with torch.device("meta"):
        return recipe.build_model()


@dataclass(frozen=True)
class _Shape:
    total: int
    trains: int
    """Parameters that train."""
    root: int
    """Parameters outside the recipe's blocks: what sharded training keeps whole for a step."""
    largest: int
    """The largest block's: sharded training gathers one block at a time."""
    split: int
    """Parameters tensor parallelism splits (0 where the recipe declares no split)."""
    split_trains: int


@functools.lru_cache(maxsize=8)
def _shape(recipe: Recipe) -> _Shape:
    """The model's parameter counts, on the meta device."""
    model = _meta_model(recipe)
    total = sum(p.numel() for p in model.parameters())
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    blocks = [sum(p.numel() for p in block.parameters()) for block in recipe.blocks(model)]
    try:
        split, split_trains = recipe.tensor_plan(model, 1).split_parameters()
    except FieldError:  # the recipe does not split its layers
        split = split_trains = 0
    return _Shape(total, trains, total - sum(blocks), max(blocks, default=0), split, split_trains)


def tensor_splits(spec: JobSpec, recipe: Recipe) -> list[int]:
    """The tp values a run of `spec` could take: 1, and each divisor of compute.cores_per_node at which
    the recipe's model splits (`Recipe.tensor_plan`), smallest first; 1 alone on the xla device."""
    if spec.compute.device == "xla":
        return [1]
    cores = spec.compute.cores_per_node
    return [1] + [tp for tp in range(2, cores + 1) if cores % tp == 0 and _splits(recipe, tp)]


@functools.lru_cache(maxsize=64)
def _splits(recipe: Recipe, tp: int) -> bool:
    try:
        recipe.tensor_plan(_meta_model(recipe), tp)
    except FieldError:
        return False
    return True


def optimizer_moments(recipe: Recipe, spec: JobSpec) -> int:
    """Values the recipe's optimizer keeps per weight (AdamW: 2), found by stepping it once on a
    small parameter: the estimate follows whatever optimizer the recipe builds."""
    weight = torch.nn.Parameter(torch.zeros(8))
    weight.grad = torch.ones(8)
    optimizer = recipe.optimizer([weight], spec.train)
    with torch.random.fork_rng(devices=[]):  # an optimizer that draws random numbers must not move the run's
        optimizer.step()
    held = sum(t.numel() for t in optimizer.state[weight].values()
               if isinstance(t, torch.Tensor) and t.numel() == weight.numel())
    return held // weight.numel()


@dataclass(frozen=True)
class MemoryPlan:
    """The per-core estimate of both strategies at the job's tp, and the layout the job uses
    (`train.parallelism`); with `auto`, also the layouts it weighed at other tps."""

    layout: Layout
    ddp: MemoryFigures
    fsdp: MemoryFigures
    weighed: tuple[MemoryFigures, ...] = ()
    """With `tp: auto`: the estimates at the tps it passed over (smaller ones, which do not fit)."""

    @property
    def strategy(self) -> str:
        return self.layout.strategy

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def chosen(self) -> MemoryFigures:
        return self.fsdp if self.strategy == "fsdp" else self.ddp

    def as_dict(self) -> dict:
        return {"strategy": self.strategy, "tp": self.tp, "ddp": self.ddp.model_dump(),
                "fsdp": self.fsdp.model_dump(), "weighed": [e.model_dump() for e in self.weighed]}

    def describe(self) -> str:
        """What `trnflow validate` prints."""
        weighed = "".join(f"; {e.describe()}" for e in self.weighed)
        return f"parallelism: {self.chosen.layout} per core: {self.ddp.describe()}; {self.fsdp.describe()}{weighed}"


def _estimates(spec: JobSpec, recipe: Recipe, itype: str, world: int, tp: int = 1, recompute: str | None = None
               ) -> tuple[MemoryFigures, MemoryFigures]:
    """Both strategies' figures at `tp`, with the blocks recomputing as `recompute` says (the spec's
    own when None, and nothing while that is still `auto`)."""
    shape = _shape(recipe)
    params, trains = shape.total, shape.trains
    precision = spec.compute.precision
    # Pure bf16 (bf16-sr, bf16-rne) keeps weights, gradients and optimizer state in bf16 on the
    # device; fp32 and bf16 autocast keep fp32 master weights. Activations follow the compute dtype.
    state_bytes = 2 if precision in ("bf16-sr", "bf16-rne") else 4
    act_bytes = 4 if precision == "fp32" else 2
    replicas = max(1, world // tp)
    batch = spec.train.global_batch_size // replicas  # each core of a tensor-parallel group computes its replica's
    activations = recipe.activation_bytes(batch, act_bytes, tp) if tp > 1 else \
        recipe.activation_bytes(batch, act_bytes)
    recomputed = recompute or spec.train.activation_checkpointing
    recomputed = "none" if recomputed == "auto" else recomputed
    fewer = recipe.recomputed_bytes(batch, act_bytes, recomputed, tp) if recomputed != "none" else None
    activations, recomputed = (activations, "none") if fewer is None else (fewer, recomputed)
    moments = optimizer_moments(recipe, spec)
    limit, rehearsal = core_limit(itype), rehearsal_core_bytes() is not None
    partly = trains if trains < params else None
    # Split layers keep 1/tp on each core (the split divides them evenly); everything else, whole.
    held = params - shape.split + shape.split // tp
    trained = trains - shape.split_trains + shape.split_trains // tp
    ddp = MemoryFigures.of("ddp", params, held * state_bytes, trained * state_bytes, moments * trained * state_bytes,
                         activations, 0, limit, tp, rehearsal, partly, recomputed)
    shard, shard_trained = -(-held // replicas), -(-trained // replicas)  # FSDP2 pads each shard on dim 0; a little
    whole = held / params if params else 1.0  # of a gathered block, the share on this core
    gathered = int((shape.root + 2 * shape.largest if shape.largest else params) * whole) * state_bytes
    fsdp = MemoryFigures.of("fsdp", params, shard * state_bytes, shard_trained * state_bytes,
                          moments * shard_trained * state_bytes, activations, gathered, limit, tp, rehearsal, partly,
                          recomputed)
    return ddp, fsdp


def plan(spec: JobSpec, recipe: Recipe | None = None, itype: str | None = None) -> MemoryPlan:
    """Both strategies' per-core estimates on `itype` (the spec's instance type) at the tp the job
    uses, and the layout it uses (`layout`). A tp the recipe cannot split is a FieldError."""
    recipe = recipe or for_job(spec)
    tp = spec.train.parallelism.tp
    if tp != "auto" and tp > 1:
        recipe.tensor_plan(_meta_model(recipe), tp)  # says why it cannot split, naming train.parallelism.tp
    chosen = layout(spec, recipe)
    itype, world = itype or spec.compute.instance_type, spec.compute.world_size
    ddp, fsdp = _estimates(spec, recipe, itype, world, chosen.tp, chosen.recompute)
    weighed = tuple(e for t in tensor_splits(spec, recipe) if t < chosen.tp
                    for e in _estimates(spec, recipe, itype, world, t, chosen.recompute)) if tp == "auto" else ()
    return MemoryPlan(chosen, ddp, fsdp, weighed)


def layout(spec: JobSpec, recipe: Recipe | None = None) -> Layout:
    """How the job spreads the model. The spec's own where it names them; `auto`
    takes the first that fits a core of every instance type the job may get
    (compute.instance_preferences), in this order: tp 1 before any split (tensor parallelism sums
    activations in every layer of every step), at each tp ddp before fsdp (which gathers each
    block's weights every step), and at each of those the least recomputation first (none,
    selective, full: train.activation_checkpointing); nothing fitting, the last (which the memory
    check then refuses with its figures). fsdp is never chosen on the xla device, which does not
    shard. A run decides it once, when its flow starts (`decided`), so that a job that falls back
    to another type keeps it."""
    wanted, recompute = spec.train.parallelism, spec.train.activation_checkpointing
    if spec.decided:
        return spec.layout
    recipe = recipe or for_job(spec)
    strategies = [wanted.strategy] if wanted.strategy != "auto" else \
        ["ddp"] if spec.compute.device == "xla" else ["ddp", "fsdp"]
    splits = [wanted.tp] if wanted.tp != "auto" else tensor_splits(spec, recipe)
    settings = [recompute] if recompute != "auto" else ["none", "selective", "full"]
    world = spec.compute.world_size
    for tp in splits:
        for chosen in strategies:
            index = 0 if chosen == "ddp" else 1
            for setting in _runnable(settings, tp):
                if all(_estimates(spec, recipe, t, world, tp, setting)[index].fits
                       for t in spec.compute.instance_choices):
                    return Layout(strategy=chosen, tp=tp, recompute=setting)
    return Layout(strategy=strategies[-1], tp=splits[-1], recompute=(_runnable(settings, splits[-1]) or settings)[-1])


def _runnable(settings: list[str], tp: int) -> list[str]:
    """The recomputation settings that run at `tp`: not `full` with split layers (the spec refuses it)."""
    return [s for s in settings if not (s == "full" and tp > 1)]


def decided(spec: JobSpec) -> JobSpec:
    """`spec` with `auto` (strategy, tp) replaced by what `layout` decides (the same spec otherwise)."""
    return spec.with_layout(layout(spec))


def estimate(spec: JobSpec, recipe: Recipe | None = None) -> MemoryFigures:
    """The per-core estimate of the strategy the job uses."""
    return plan(spec, recipe).chosen


def _smallest_fit(spec: JobSpec, recipe: Recipe) -> str | None:
    """The fewest cores, over the training instance types, on which fsdp (with the layers split, if
    that is what it takes) would fit and the spec could run (its batch divides over them, its device
    runs there); None if none. One instance may give fewer than all its cores; several give all of theirs."""
    candidates = sorted(
        (nodes * cores, name, nodes, cores) for name in TRAINING_TYPES
        for nodes in range(1, (MAX_SUGGESTED_NODES if instance(name).multi_node else 1) + 1)
        for cores in ([instance(name).cores] if nodes > 1 else range(1, instance(name).cores + 1))
        if spec.train.global_batch_size % (nodes * cores) == 0)
    for world, name, nodes, cores in candidates:
        data = spec.model_dump()
        data["compute"].update(instance_type=name, nodes=nodes, cores_per_node=cores, instance_preferences=[])
        data["train"]["parallelism"].update(strategy="fsdp", tp=1)
        try:  # a suggestion the spec could take: the device runs there, fsdp runs on it
            resized = type(spec).model_validate(data)
        except ValidationError:
            continue
        for tp in tensor_splits(resized, recipe):
            if _estimates(resized, recipe, name, world, tp)[1].fits:
                shape = f"{nodes} x {name}" if nodes > 1 or cores == instance(name).cores else \
                    f"1 x {name} at compute.cores_per_node {cores}"
                split = f" and tp {tp}" if tp > 1 else ""
                return f"{shape} ({world} cores) with train.parallelism.strategy fsdp{split}"
    return None


def _recomputation_that_fits(spec: JobSpec, recipe: Recipe, itype: str, chosen: Layout) -> str | None:
    """The least recomputation with which `chosen` would fit an `itype` core, when the spec names
    one that keeps more; None when none would, or the spec leaves it to the planner."""
    wanted = spec.train.activation_checkpointing
    if wanted in ("auto", "full"):
        return None
    index = 0 if chosen.strategy == "ddp" else 1
    for setting in _runnable(["selective", "full"][1 if wanted == "selective" else 0:], chosen.tp):
        if _estimates(spec, recipe, itype, spec.compute.world_size, chosen.tp, setting)[index].fits:
            return setting
    return None


def check_fits(spec: JobSpec) -> MemoryPlan:
    """The plan, or FatalError with the numbers and what to change: on every instance type the job
    may get (compute.instance_preferences). A tp the recipe cannot split is a FieldError."""
    recipe = for_job(spec)
    for name in spec.compute.instance_choices:
        found = plan(spec, recipe, name)
        if found.chosen.fits:
            continue
        est = found.chosen
        fix = ("Lower train.global_batch_size, shrink the model (model.params), use compute.precision bf16-sr, "
               "or spread the batch over more cores")
        if spec.train.parallelism.strategy == "ddp" and found.fsdp.fits and spec.compute.device != "xla":
            fix = "Set train.parallelism.strategy: fsdp (or auto), which shards it over the job's cores"
        elif not found.fsdp.fits:
            smallest = _smallest_fit(spec, recipe)
            fix += f"; the smallest that fits: {smallest}" if smallest else "; no instance in the catalogue fits it"
        recomputing = _recomputation_that_fits(spec, recipe, name, found.layout)
        if recomputing is not None:
            fix += (f"; or set train.activation_checkpointing: {recomputing} (or auto), which fits it as it is by "
                    "recomputing the blocks' activations in the backward pass instead of keeping them")
        other = found.fsdp if est.strategy == "ddp" else found.ddp
        raise FatalError(
            f"the job needs about {byte_size(est.total)} of device memory per NeuronCore with {est.layout} "
            f"({est.describe()}; {other.describe()}) but a {name} core has {byte_size(est.per_core_limit)}"
            f"{' in this rehearsal' if est.rehearsal else ''}. {fix}")
    for name in spec.compute.instance_choices:
        _check_staging(spec, plan(spec, recipe, name).chosen, name)
    return plan(spec, recipe)


def _check_staging(spec: JobSpec, figures: MemoryFigures, itype: str) -> None:
    """FatalError, naming train.checkpoint_async, when a node's checkpoint written in the background
    would not fit the host memory it may take (`staging_limit`)."""
    staged = staged_per_node(spec, figures)
    limit, rehearsal = staging_limit(itype)
    if staged > limit:
        whose = "of rank 0" if figures.strategy == "ddp" and figures.tp == 1 else "of every rank on it"
        raise FatalError(
            f"train.checkpoint_async: a checkpoint written in the background is first copied into host memory, "
            f"about {byte_size(staged)} on each {itype} with {figures.layout} (the trained weights and optimizer "
            f"state {whose}), more than the {byte_size(limit)} it may take (half the host's memory"
            f"{' in this rehearsal' if rehearsal else ''}). Set train.checkpoint_async: false, which writes each "
            "checkpoint before training goes on, or spread the model over more nodes")


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    """The bytes these tensors hold on this rank: of a sharded one (a DTensor), this rank's shard."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


@contextmanager
def saved_activation_peak() -> Iterator[dict]:
    """Measure the bytes autograd saves for backward while the block runs: `out["peak"]`."""
    out = {"current": 0, "peak": 0}

    def pack(t: torch.Tensor) -> tuple[torch.Tensor, int]:
        size = t.numel() * t.element_size()
        out["current"] += size
        out["peak"] = max(out["peak"], out["current"])
        return t, size

    def unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
        return packed[0]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield out
