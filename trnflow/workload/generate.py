"""Text generation in batch inference (`inference.generate`), with one program shape throughout.

Each batch's prompts sit at the start of a fixed buffer of `seq_len + max_new_tokens` tokens, and
every step runs the recipe's `generate_step` program on the whole buffer, reading the logits at
each row's own length: the model attends only backwards, so what lies after a row's length is never
seen, and every step is the same compiled graph (no cache of keys and values, whose shape would
grow). The token is chosen on the host: the most likely one (greedy, the default), or drawn at
`temperature` (from the `top_k` most likely) with a generator of the row's own, seeded by
`seed` and the row's id, so that a rerun, or a shard redone after a failure, writes the same
completion whatever batch the row is in. A row stops at the recipe's end token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from trnflow.specs import GenerateSpec
from trnflow.workload.recipes import Recipe


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


def generate(next_logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], recipe: Recipe,
             features: torch.Tensor, row_ids: list[str], settings: GenerateSpec) -> list[list[int]]:
    """The tokens generated for each row of one fixed-size batch (`row_ids` name its rows; a filled
    batch's copies repeat an id), its end token included when it was reached."""
    buffer, lengths = recipe.prompts(features, settings.max_new_tokens)
    rows = len(features)
    generators = [row_generator(settings.seed, r) for r in row_ids] if settings.temperature > 0 else None
    end, done = recipe.end_token, torch.zeros(rows, dtype=torch.bool)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    at = lengths.clone()
    for _ in range(settings.max_new_tokens):
        chosen = choose(next_logits(buffer, at), settings, generators)
        for i in (~done).nonzero().flatten().tolist():
            tokens[i].append(int(chosen[i]))
            done[i] = end is not None and int(chosen[i]) == end
        going = ~done
        buffer[going.nonzero().flatten(), at[going]] = chosen[going]
        at = at + going.long()
        if not going.any():
            break
    return tokens
