"""A data set featurized a batch at a time, so that its size is bounded by local disk, not memory.

The rows stream in (`trnflow.workload.data`), the recipe turns each batch into features, and the
features go to `FeatureRows`: in memory while they are small, else to an unnamed temporary file on
local disk (gone when the process ends), from which each training or inference batch reads just its
rows. The labels (8 bytes a row) and the ids (inference only) stay in memory, compactly.
"""

from __future__ import annotations

import hashlib
import math
import os
import resource
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import torch

from trnflow.measures import HostMemory
from trnflow.results import PackingFill
from trnflow.workload import watchdog
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.data import labels_of, lines
from trnflow.workload.recipes import Recipe

IN_MEMORY_ENV = "TRNFLOW_FEATURES_IN_MEMORY_MB"
IN_MEMORY_MB = 256
"""Features up to this size stay in memory; beyond it they are spilled to local disk."""


def in_memory_bytes() -> int:
    return int(float(os.environ.get(IN_MEMORY_ENV, IN_MEMORY_MB)) * (1 << 20))


class FeatureRows:
    """Fixed-shape feature rows appended a batch at a time and read back by index, like a tensor:
    `rows[idx]` for a tensor of row numbers, in their order."""

    def __init__(self, limit_bytes: int | None = None):
        self.limit = in_memory_bytes() if limit_bytes is None else limit_bytes
        self._parts: list[torch.Tensor] = []
        self._memory: torch.Tensor | None = None
        self._file = None
        self.shape: tuple[int, ...] = ()
        self.dtype = torch.float32
        self.rows = 0

    @property
    def spilled(self) -> bool:
        return self._file is not None

    def append(self, features: torch.Tensor) -> None:
        if not self.rows and not self._parts:
            self.shape, self.dtype = tuple(features.shape[1:]), features.dtype
        elif tuple(features.shape[1:]) != self.shape or features.dtype != self.dtype:
            raise ValueError(f"the recipe gave features of shape {tuple(features.shape[1:])} and {features.dtype} "
                             f"after {self.shape} and {self.dtype}: every row must have one shape")
        self.rows += len(features)
        if self._file is not None:
            self._write(features)
            return
        self._parts.append(features.contiguous())
        if self.rows * self._row_bytes > self.limit:
            self._file = tempfile.TemporaryFile(prefix="trnflow-features-")  # noqa: SIM115 (closed in close())
            for part in self._parts:
                self._write(part)
            self._parts = []

    @property
    def _row_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def _write(self, features: torch.Tensor) -> None:
        self._file.write(features.contiguous().numpy())  # its buffer, not a copy of it

    def finish(self) -> FeatureRows:
        if self._file is not None:
            self._file.flush()
        elif self._parts:
            self._memory = torch.cat(self._parts) if len(self._parts) > 1 else self._parts[0]
            self._parts = []
        else:
            self._memory = torch.empty(0, *self.shape, dtype=self.dtype)
        return self

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index: torch.Tensor) -> torch.Tensor:
        if self._memory is not None:
            return self._memory[index]
        wanted = torch.as_tensor(index).reshape(-1).tolist()
        if not wanted:
            return torch.empty(0, *self.shape, dtype=self.dtype)
        if min(wanted) < 0 or max(wanted) >= self.rows:
            raise IndexError(f"row {min(wanted) if min(wanted) < 0 else max(wanted)} is outside the "
                             f"{self.rows} featurized rows")
        size, fd = self._row_bytes, self._file.fileno()
        if wanted == list(range(wanted[0], wanted[0] + len(wanted))):  # a run of rows: one read
            data = os.pread(fd, size * len(wanted), wanted[0] * size)
        else:
            data = b"".join(os.pread(fd, size, i * size) for i in wanted)
        return torch.frombuffer(bytearray(data), dtype=self.dtype).reshape(len(wanted), *self.shape)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@dataclass
class Featurized:
    features: FeatureRows
    labels: torch.Tensor | None
    """Training and holdout sets: each row's class."""
    ids: pa.ChunkedArray | None
    """The inference set: each row's id."""
    digest: str
    """sha256 over each row's id (or label) and columns, in order: what was read."""
    packing: PackingFill | None = None
    """Packed (`pack`): how the rows filled the windows, which `features` then holds (labels 0)."""

    def __len__(self) -> int:
        return len(self.features)


def featurize(batches: Iterable[pa.Table], recipe: Recipe, *, label_field: str | None = None,
              id_field: str | None = None, digest: bool = False, pack: bool = False) -> Featurized:
    """Featurize `batches` (the recipe's columns, and the label or id column) one at a time; with
    `digest`, hash each row as `<label or id>\\t<columns>` on the way; with `pack`, pack the rows
    into windows as they come (`trnflow.workload.packing`; the recipe's labels are all 0)."""
    features, labels, ids, hashed = FeatureRows(), [], [], hashlib.sha256()
    packer = recipe.packer() if pack else None
    columns = recipe.columns()
    for table in batches:
        watchdog.beat("reading rows")
        mine = table.select(columns)
        if digest:
            keys = table.column(label_field or id_field).to_pylist()
            for key, line in zip(keys, lines(mine), strict=True):
                hashed.update(f"{key}\t{line}\n".encode())
        if label_field:
            labels.append(labels_of(table, label_field))
        if id_field:
            ids.append(pa.table({"id": table.column(id_field)}))
        if mine.num_rows:
            rows = recipe.features(mine)
            features.append(packer.add(rows) if packer is not None else rows)
    if packer is not None:
        features.append(packer.finish())
        labels = [torch.zeros(len(features), dtype=torch.long)]
    return Featurized(
        features.finish(),
        (torch.cat(labels) if labels else torch.empty(0, dtype=torch.long)) if label_field else None,
        pa.concat_tables(ids, promote_options="permissive").column("id") if id_field else None,
        hashed.hexdigest() if digest else "",
        packer.fill() if packer is not None else None,
    )


def host_memory(ctx: WorkerContext, features: FeatureRows) -> HostMemory:
    """What the ranks held in host memory (their peak resident set, which the rows read a batch at a
    time keep bounded) and whether the featurized rows went to local disk."""
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return HostMemory(peak_rss_mb_per_rank=[round(mb, 1) for mb in gather_objects(ctx, peak_mb)], rows=len(features),
                      features_spilled_to_disk=features.spilled)
