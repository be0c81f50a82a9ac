"""Where packed rows go (`data.packing`), torch-free: `trnflow data check` reckons the fill with it,
and the training's `Packer` places each row by it, so the two never disagree.

Rows go into windows of `seq_len` tokens in the order they are read: a row goes into the window
being filled if it fits, else it starts the next. The windows are thereby a function of the rows
alone, in their order.
"""

from __future__ import annotations

from trnflow.results import PackingFill


class NextFit:
    """The windows of rows placed one after another (`place`), and how full they are (`fill`)."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.rows = self.windows = self.tokens = 0
        self._used = seq_len  # no window open yet

    def place(self, length: int) -> tuple[bool, int]:
        """Place a row of `length` tokens (1 to seq_len): whether it starts a new window, and where
        in its window it begins."""
        if not 0 < length <= self.seq_len:
            raise ValueError(f"a row of {length} tokens cannot be packed into windows of {self.seq_len}")
        new = self._used + length > self.seq_len
        if new:
            self.windows, self._used = self.windows + 1, 0
        begins, self._used = self._used, self._used + length
        self.rows, self.tokens = self.rows + 1, self.tokens + length
        return new, begins

    def fill(self) -> PackingFill:
        return PackingFill(rows=self.rows, windows=self.windows, tokens=self.tokens, seq_len=self.seq_len)
