"""Sequence packing (`data.packing`): several rows of tokens in each training window.

A language model's rows are padded to `seq_len` one per row, so short rows waste most of a step.
Packed, the rows share windows of the same `seq_len`, placed as `windows.FirstFit` says (the
windows are a function of the rows in their order, so a run resumed at a window resumes exactly
where it stopped). A row's features are its token ids, 1 for each real token and 1 for each
counted one (channels 0 to 2, its tokens at its start, as `hf-causal-lm` makes them); a window's
add its tokens' positions (channel 3), which restart at 0 with each row. The model attends within
each row only (a row: a run of positions from 0; the recipe's mask says so) and counts no row's
first token as predicted from the row before it, so the loss counts exactly the tokens it counts
unpacked. One shape throughout: (windows, 4, seq_len).
"""

from __future__ import annotations

import torch

from trnflow.results import PackingFill
from trnflow.workload.windows import FirstFit

CHANNELS = 4
"""A window's channels: ids, real, counted, positions."""


class Packer:
    """Rows of token features packed into windows as they stream in (`add`, then `finish`), each
    placed as `FirstFit` says; windows come out as they close."""

    def __init__(self, seq_len: int, pad_id: int):
        self.seq_len, self.pad_id = seq_len, pad_id
        self._fit = FirstFit(seq_len)
        self._windows: dict[int, torch.Tensor] = {}

    def _open(self) -> torch.Tensor:
        window = torch.zeros(CHANNELS, self.seq_len, dtype=torch.long)
        window[0] = self.pad_id
        window[3] = torch.arange(self.seq_len)  # the padding after the last row: never a counted token's context
        return window

    def _emit(self, closed: list[int]) -> torch.Tensor:
        done = [self._windows.pop(w) for w in closed]
        return torch.stack(done) if done else torch.empty(0, CHANNELS, self.seq_len, dtype=torch.long)

    def add(self, features: torch.Tensor) -> torch.Tensor:
        """Pack `features` (rows, 3, seq_len); the windows closed meanwhile, (windows, 4, seq_len). A
        row with no tokens is left out (it counts nothing either way)."""
        for row, length in zip(features, features[:, 1].sum(1).tolist(), strict=True):
            if length == 0:
                continue
            window, begins = self._fit.place(length)
            into = self._windows.setdefault(window, self._open())
            into[:3, begins:begins + length] = row[:3, :length]
            into[3, begins:begins + length] = torch.arange(length)
        return self._emit(self._fit.closed())

    def finish(self) -> torch.Tensor:
        """The windows still open: (windows, 4, seq_len)."""
        return self._emit(self._fit.closed(everything=True))

    def fill(self) -> PackingFill:
        return self._fit.fill()


def one_per_window(features: torch.Tensor) -> torch.Tensor:
    """`features` (rows, 3, seq_len) as windows of one row each: the shape of packed input, for trial runs."""
    positions = torch.arange(features.shape[-1]).expand(len(features), 1, -1)
    return torch.cat([features, positions.to(features.dtype)], 1)


def counted_targets(counted: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The counted mask with each row's first token left out when rows are packed: no token is
    predicted from the row before it (unpacked, a row's first token is never a target anyway)."""
    return counted if positions is None else counted * (positions != 0)
