"""bf16 numerics as on Trainium: fp32 values rounded onto the bf16 grid, stochastically or to nearest even."""

from __future__ import annotations

import torch

from trnflow.device.base import NEAREST, STOCHASTIC


def stochastic_round_bf16_(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Round an fp32 tensor in place to a bf16-representable value, up or down at random.

    Adding 16 random low bits before truncating rounds up with probability equal to the distance
    from the lower neighbour, so the rounding is unbiased: E[round(x)] = x.
    """
    if t.dtype != torch.float32:
        raise TypeError(f"stochastic rounding expects float32, got {t.dtype}")
    bits = t.view(torch.int32)
    noise = torch.randint(0, 1 << 16, t.shape, dtype=torch.int32, generator=generator)
    bits.add_(noise).bitwise_and_(-65536)
    return t


def nearest_round_bf16_(t: torch.Tensor) -> torch.Tensor:
    """Round an fp32 tensor in place to the nearest bf16-representable value (ties to even), as a
    plain cast does: an update smaller than half the spacing of bf16 there is lost."""
    if t.dtype != torch.float32:
        raise TypeError(f"rounding to bf16 expects float32, got {t.dtype}")
    return t.copy_(t.to(torch.bfloat16))


def round_bf16_(t: torch.Tensor, mode: str, generator: torch.Generator) -> torch.Tensor:
    """`t` on the bf16 grid, rounded as `mode` ("stochastic" or "nearest") says."""
    if mode == STOCHASTIC:
        return stochastic_round_bf16_(t, generator)
    if mode == NEAREST:
        return nearest_round_bf16_(t)
    raise ValueError(f"unknown rounding {mode!r}; use {STOCHASTIC!r} or {NEAREST!r}")
