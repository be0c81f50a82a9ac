"""Generation with a static cache of keys and values (`inference.generate.kv_cache`): two programs
of fixed shapes, a prefill and a one-token decode, instead of the whole buffer at every token.

Rows of a batch have prompts of different lengths, and a fixed-shape cache is written at one slot
for the whole batch per step, so the prompts are laid out to end together: row i's prompt of
`length` tokens fills slots `start = width - length` to `width - 1` of its cache, where `width` is
the rows' `seq_len`, and generated token t goes to slot `width + t` in every row. Each token is
given its own position (its place in its row, from 0) and a mask that lets it see the slots of
its own row up to itself, so a row's tokens see and are seen exactly as when it stands alone; a
slot before a row's start sees only itself (a fully masked query would give NaN, which the masked
values would still carry into every score they are multiplied with). The cache is
`(layers, 2, rows, kv_heads, width + room, head_dim)`, one tensor in and out of each program:
a step's new keys and values are copied into a fresh cache (no tensor is changed in place, so the
programs are pure functions on every device).

Only decoders that take positions and a 4-D mask as given use it (`positions_refused`); others
recompute the buffer (`generate_step`)."""

from __future__ import annotations

from typing import Any

import torch


class StaticKeyValues:
    """The cache transformers' attention layers write through (`update`, as they call it): every
    layer's keys and values at the step's slot, or, in the prefill (`slot` None), as they come."""

    def __init__(self, cache: torch.Tensor | None = None, slot: torch.Tensor | None = None):
        self.cache, self.slot = cache, slot
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cache is not None and self.slot is not None:
            keys = self.cache[layer, 0].index_copy(2, self.slot.view(1), keys.to(self.cache.dtype))
            values = self.cache[layer, 1].index_copy(2, self.slot.view(1), values.to(self.cache.dtype))
        self.keys[layer], self.values[layer] = keys, values
        return keys, values

    def stacked(self, room: int = 0) -> torch.Tensor:
        """The cache after the step: every layer's keys and values, each `room` more slots long
        (the prefill's: room for the tokens to come)."""
        layers = sorted(self.keys)
        pairs = [torch.stack([self.keys[i], self.values[i]]) for i in layers]
        whole = torch.stack(pairs)
        return torch.nn.functional.pad(whole, (0, 0, 0, room)) if room else whole


def attention_mask(allowed: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True where a query may look) as `attention` takes it: as it is (sdpa), or
    added to the scores (eager)."""
    if attention == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                        torch.finfo(dtype).min)
    return allowed


def prefill_inputs(starts: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' positions (rows, width) and which slots each query may see (rows, 1, width,
    width): its own row's, up to itself; a slot before the row's start, itself alone."""
    at = torch.arange(width, device=starts.device)
    positions = (at - starts.unsqueeze(1)).clamp(min=0)
    query, key = at.view(1, -1, 1), at.view(1, 1, -1)
    allowed = ((key >= starts.view(-1, 1, 1)) & (key <= query)) | (key == query)
    return positions, allowed.unsqueeze(1)


def decode_inputs(starts: torch.Tensor, slot: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' positions (rows, 1) and the slots of a cache `length` long each may see
    (rows, 1, 1, length): its own row's, up to its own slot."""
    at = torch.arange(length, device=starts.device)
    allowed = (at >= starts.unsqueeze(1)) & (at <= slot)
    return (slot - starts).unsqueeze(1), allowed.view(len(starts), 1, 1, length)
