"""Sampling a training set deterministically across ranks, and batches of one static shape.

The data position is a pure function of the global step (`StepSampler`), so a resumed run sees the
same batches whatever its world size. Shapes are static, as on Trainium: every per-core batch has
the same size, and evaluation and inference fill their last batch up (`static_batches`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from trnflow.errors import DataError


def static_batches(features: torch.Tensor, rows: torch.Tensor, batch_size: int
                   ) -> Iterator[tuple[torch.Tensor, int]]:
    """Fixed-shape batches over `rows`: the last one is filled up with copies of its first row, so
    every forward pass has the same shape and nothing recompiles; their outputs are dropped.
    Yields (features, number of real rows)."""
    for chunk in rows.split(batch_size):
        batch = features[chunk]
        if len(chunk) < batch_size:
            batch = torch.cat([batch, batch[:1].expand(batch_size - len(chunk), *batch.shape[1:])])
        yield batch, len(chunk)


class StepSampler:
    """The data position is a pure function of the global step, so a resumed run sees the same batches.

    Epoch e visits the rows in `randperm(n, seed + e)` order, `global_batch` rows per step; rank r
    takes its contiguous slice of each global batch. The same global batches are seen whatever the
    world size, which lets a checkpoint from 4 ranks resume on 2.

    With `drop_last` (the default, and what Trainium needs) an epoch ends with its last full batch.
    Without it, the epoch's last step takes the rows left over, shared evenly across the ranks: a
    smaller batch, which is a new shape and so a recompilation.
    """

    def __init__(self, n_rows: int, global_batch: int, rank: int, world: int, seed: int, drop_last: bool = True,
                 packed: bool = False):
        """`packed`: the samples are windows of packed rows (`data.packing`), which `n_rows` counts."""
        if n_rows < global_batch:
            raise DataError(
                f"the training set has {n_rows} {'windows' if packed else 'rows'}, fewer than one global batch "
                f"({global_batch}); add data or lower train.global_batch_size"
            )
        self.n, self.global_batch, self.seed, self.packed = n_rows, global_batch, seed, packed
        self.rank, self.world = rank, world
        self.per_rank = global_batch // world
        full, left = divmod(n_rows, global_batch)
        self.steps_per_epoch = full + (1 if not drop_last and left >= world else 0)
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def position(self, step: int) -> dict:
        """Where the sampler stands after `step` steps: saved in checkpoints, checked on resume."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "batch_in_epoch": batch, "rows": self.n,
                "global_batch": self.global_batch, "seed": self.seed,
                **({"packed": 1} if self.packed else {})}  # (then `rows` counts windows)

    def restore(self, position: dict) -> int:
        """The step to continue from; refuses a position saved over different data or batches."""
        mine = self.position(position["step"])
        position, mine = {"packed": 0, **position}, {"packed": 0, **mine}
        changed = [k for k in ("packed", "rows", "global_batch", "seed") if position.get(k) != mine[k]]
        if changed:
            raise DataError(
                f"the checkpoint's sampler saw {', '.join(f'{k}={position.get(k)}' for k in changed)} but this run "
                f"has {', '.join(f'{k}={mine[k]}' for k in changed)}; an exact resume needs the same data and "
                "batch size. Start a new run (a new run id) to train on different data"
            )
        return int(position["step"])

    def indices(self, step: int) -> torch.Tensor:
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=gen)
        batch = self._perm[within * self.global_batch : (within + 1) * self.global_batch]
        per_rank = len(batch) // self.world
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def batches(self, first_step: int, last_step: int) -> Iterator[tuple[int, torch.Tensor]]:
        for step in range(first_step, last_step):
            yield step, self.indices(step)
