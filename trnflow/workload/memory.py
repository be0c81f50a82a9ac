"""The device-memory budget of one NeuronCore: estimated before launch, measured during a run.

The estimate counts what a data-parallel training step keeps on each core of the real device:
weights, gradients, the optimizer's state (AdamW's two moments, or whatever the recipe's optimizer
keeps per weight) and the activations saved for the backward pass, in the
spec's precision. A job whose estimate exceeds the instance's memory per core is refused before it
starts. (The emulator itself holds pure-bf16 state in fp32 tensors whose values lie on the bf16
grid, so what a run measures for bf16-sr or bf16-rne is about twice the device estimate.)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import torch

from trnflow.errors import FatalError
from trnflow.specs import JobSpec, instance
from trnflow.workload.recipes import Recipe, for_job

GIB = 1024**3


def parameter_count(recipe: Recipe) -> int:
    """Exact, without allocating: the model is built on the meta device."""
    with torch.device("meta"):
        model = recipe.build_model()
    return sum(p.numel() for p in model.parameters())


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
class MemoryEstimate:
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    activations: int
    per_core_limit: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.per_core_limit

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total, "fits": self.fits}


def estimate(spec: JobSpec, recipe: Recipe | None = None) -> MemoryEstimate:
    recipe = recipe or for_job(spec)
    params = parameter_count(recipe)
    precision = spec.compute.precision
    # Pure bf16 (bf16-sr, bf16-rne) keeps weights, gradients and optimizer state in bf16 on the
    # device; fp32 and bf16 autocast keep fp32 master weights. Activations follow the compute dtype.
    state_bytes = 2 if precision in ("bf16-sr", "bf16-rne") else 4
    act_bytes = 4 if precision == "fp32" else 2
    activations = recipe.activation_bytes(spec.per_core_batch, act_bytes)
    return MemoryEstimate(
        parameters=params,
        weights=params * state_bytes,
        gradients=params * state_bytes,
        optimizer=optimizer_moments(recipe, spec) * params * state_bytes,
        activations=activations,
        per_core_limit=instance(spec.compute.instance_type).core_memory_bytes,
    )


def check_fits(spec: JobSpec) -> MemoryEstimate:
    """The estimate, or FatalError with both numbers and what to change: on every instance type the
    job may get (compute.instance_preferences)."""
    est = estimate(spec)
    for name in spec.compute.instance_choices:
        t = instance(name)
        if est.total <= t.core_memory_bytes:
            continue
        est = replace(est, per_core_limit=t.core_memory_bytes)
        raise FatalError(
            f"the job needs about {est.total / GIB:.1f} GiB of device memory per NeuronCore "
            f"(weights {est.weights / GIB:.1f}, gradients {est.gradients / GIB:.1f}, optimizer "
            f"{est.optimizer / GIB:.1f}, activations {est.activations / GIB:.1f}) but a {t.name} core has "
            f"{est.per_core_limit / GIB:.1f} GiB. Lower train.global_batch_size, shrink the model "
            "(model.params), use compute.precision bf16-sr, or spread the batch over more cores"
        )
    return est


def tensor_bytes(tensors: Iterator[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
