"""bf16 numerics as on Trainium: stochastic rounding of fp32 values onto the bf16 grid."""

from __future__ import annotations

import torch


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
