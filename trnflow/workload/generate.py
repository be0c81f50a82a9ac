"""Text generation in batch inference (`inference.generate`), with fixed program shapes throughout.

Each batch's prompts sit at the start of a fixed buffer of `seq_len + max_new_tokens` tokens. With
the cache of keys and values (`kv_cache`, the default), the prompts are computed once (the recipe's
`prefill_step` program), and each new token then alone (`decode_step`), its keys and values written
into a cache of the buffer's size (`Caching`). Without it, every step runs the `generate_step`
program on the whole buffer, reading the logits at each row's own length (`Recomputing`): the model
attends only backwards, so what lies after a row's length is never seen. The token is chosen on the
host: the most likely one (greedy, the default), or drawn at `temperature` (from the `top_k` most
likely) with a generator of the row's own, seeded by `seed` and the row's id, so that a rerun, or a
shard redone after a failure, writes the same completion whatever batch the row is in. A row stops
at the recipe's end token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol

import torch

from trnflow.specs import GenerateSpec
from trnflow.workload.recipes import Recipe


class Decoding(Protocol):
    """How one generation gets the logits of each row's next token (rows, vocabulary)."""

    def start(self, buffer: torch.Tensor, lengths: torch.Tensor, room: int) -> torch.Tensor:
        """The logits after each row's prompt: its first `lengths` tokens of `buffer` (rows, seq_len + room)."""

    def step(self, chosen: torch.Tensor, going: torch.Tensor) -> torch.Tensor:
        """The logits after each row's `chosen` token, where it is still `going`."""


class Recomputing:
    """Each step through `next_logits` (`generate_step`): the whole buffer, the chosen tokens
    written after each row's own length."""

    def __init__(self, next_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.next_logits = next_logits
        self.buffer = self.at = torch.empty(0)

    def start(self, buffer: torch.Tensor, lengths: torch.Tensor, room: int) -> torch.Tensor:
        self.buffer, self.at = buffer, lengths.clone()
        return self.next_logits(self.buffer, self.at)

    def step(self, chosen: torch.Tensor, going: torch.Tensor) -> torch.Tensor:
        self.buffer[going.nonzero().flatten(), self.at[going]] = chosen[going]
        self.at = self.at + going.long()
        return self.next_logits(self.buffer, self.at)


Prefill = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
Decode = Callable[[torch.Tensor, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Caching:
    """The prompts through `prefill` (`prefill_step`), moved to end together at the rows' seq_len
    (`end_aligned`), then one token a step through `decode` (`decode_step`), every row's at the
    same slot of the cache, which stays where the programs run. A row that has ended goes on being
    fed (its tokens are not kept): the batch keeps its shape."""

    def __init__(self, prefill: Prefill, decode: Decode):
        self.prefill, self.decode = prefill, decode
        self.starts = self.cache = torch.empty(0)
        self.slot = 0

    def start(self, buffer: torch.Tensor, lengths: torch.Tensor, room: int) -> torch.Tensor:
        width = buffer.shape[1] - room
        prompts, self.starts = end_aligned(buffer, lengths, width)
        logits, self.cache = self.prefill(prompts, self.starts, room)
        self.slot = width
        return logits

    def step(self, chosen: torch.Tensor, going: torch.Tensor) -> torch.Tensor:
        logits, self.cache = self.decode(chosen, self.slot, self.starts, self.cache)
        self.slot += 1
        return logits


def end_aligned(ids: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts at the start of their rows (`ids`, rows x at least `width`) moved to end at `width`;
    each row's first slot (`width - length`). What lies before a row's start is never seen."""
    starts = width - lengths
    at = (torch.arange(width) - starts.unsqueeze(1)).clamp(min=0)
    return ids[:, :width].gather(1, at), starts


def row_generator(seed: int, row_id: str) -> torch.Generator:
    """The generator of one row's draws: the same for the same seed and id."""
    digest = hashlib.sha256(f"{seed}\0{row_id}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def choose(logits: torch.Tensor, settings: GenerateSpec, generators: list[torch.Generator] | None) -> torch.Tensor:
    """Each row's next token from its logits (rows, vocabulary)."""
    if settings.temperature == 0 or generators is None:
        return logits.argmax(-1)
    scaled = logits.double() / settings.temperature
    if settings.top_k is not None and settings.top_k < scaled.shape[-1]:
        kth = scaled.topk(settings.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probabilities = scaled.softmax(-1)
    return torch.stack([torch.multinomial(p, 1, generator=g)[0] for p, g in zip(probabilities, generators,
                                                                                strict=True)])


def generate(decoding: Decoding, recipe: Recipe, features: torch.Tensor, row_ids: list[str],
             settings: GenerateSpec) -> list[list[int]]:
    """The tokens generated for each row of one fixed-size batch (`row_ids` name its rows; a filled
    batch's copies repeat an id), its end token included when it was reached."""
    buffer, lengths = recipe.prompts(features, settings.max_new_tokens)
    rows = len(features)
    generators = [row_generator(settings.seed, r) for r in row_ids] if settings.temperature > 0 else None
    end, done = recipe.end_token, torch.zeros(rows, dtype=torch.bool)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    logits = decoding.start(buffer, lengths, settings.max_new_tokens)
    for made in range(1, settings.max_new_tokens + 1):
        chosen = choose(logits, settings, generators)
        for i in (~done).nonzero().flatten().tolist():
            tokens[i].append(int(chosen[i]))
            done[i] = end is not None and int(chosen[i]) == end
        if done.all() or made == settings.max_new_tokens:
            break
        logits = decoding.step(chosen, ~done)
    return tokens


def rehearse(decoding: Decoding, recipe: Recipe, features: torch.Tensor, settings: GenerateSpec,
             steps: int = 1) -> None:
    """Run a generation's programs as a generation of `settings` would, on `features`: its start
    and `steps` more tokens (the compile stage's trial, and inference's warm-up)."""
    buffer, lengths = recipe.prompts(features, settings.max_new_tokens)
    logits = decoding.start(buffer, lengths, settings.max_new_tokens)
    going = torch.ones(len(features), dtype=torch.bool)
    for _ in range(steps):
        logits = decoding.step(logits.argmax(-1), going)
