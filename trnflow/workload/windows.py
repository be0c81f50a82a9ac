"""Where packed rows go (`data.packing`), torch-free: `trnflow data check` reckons the fill with it,
and the training's `Packer` places each row by it, so the two never disagree.

Rows are placed in the order they are read, each into the first of the open windows (at most
`OPEN`, oldest first) that has room for it, else into a new one; opening one more than `OPEN`
closes the oldest, as does filling one. A window once closed is final. The windows are thereby a
function of the rows alone, in their order, while a short row can still fill the gap a long one
left a few rows before (first fit over a bounded set: nearly the fill of sorting every row first,
without holding them all).
"""

from __future__ import annotations

from trnflow.results import PackingFill

OPEN = 16
"""Windows kept open for rows to fill."""


class FirstFit:
    """The windows of rows placed one after another (`place`), those closed since asked (`closed`),
    and how full they are (`fill`). Windows are numbered from 0 in the order they were opened."""

    def __init__(self, seq_len: int, open_windows: int = OPEN):
        self.seq_len, self.limit = seq_len, open_windows
        self.rows = self.windows = self.tokens = 0
        self._open: dict[int, int] = {}  # window -> tokens used, oldest first
        self._closed: list[int] = []

    def place(self, length: int) -> tuple[int, int]:
        """Place a row of `length` tokens (1 to seq_len): its window, and where in it it begins."""
        if not 0 < length <= self.seq_len:
            raise ValueError(f"a row of {length} tokens cannot be packed into windows of {self.seq_len}")
        window = next((w for w, used in self._open.items() if used + length <= self.seq_len), None)
        if window is None:
            window, self.windows = self.windows, self.windows + 1
            self._open[window] = 0
            if len(self._open) > self.limit:
                self._close(next(iter(self._open)))
        begins = self._open[window]
        self._open[window] = begins + length
        if begins + length == self.seq_len:
            self._close(window)
        self.rows, self.tokens = self.rows + 1, self.tokens + length
        return window, begins

    def _close(self, window: int) -> None:
        del self._open[window]
        self._closed.append(window)

    def closed(self, everything: bool = False) -> list[int]:
        """The windows closed since the last call, in the order they closed; with `everything`, the
        open ones too (closed now, oldest first): the rows have all been placed."""
        if everything:
            for window in list(self._open):
                self._close(window)
        done, self._closed = self._closed, []
        return done

    def fill(self) -> PackingFill:
        return PackingFill(rows=self.rows, windows=self.windows, tokens=self.tokens, seq_len=self.seq_len)
