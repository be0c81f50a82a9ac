"""Reading text datasets (JSONL, Parquet, CSV; a file or a tree of dt=YYYY-MM-DD partitions),
turning them into fixed-shape token tensors, and sampling them deterministically across ranks.

Shapes are static, as on Trainium: every sequence is padded or cut to `seq_len`, every per-core
batch has the same size (the last partial batch of an epoch is dropped).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq
import torch

from jobspecs import DataSpec
from trnflow.errors import DataError
from trnflow.storage import local_path
from trnflow.workload.model import CLS_ID, PAD_ID

_EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "csv": (".csv",)}
_WORD = re.compile(r"[a-z0-9']+")


def data_files(url: str, fmt: str) -> list[Path]:
    """The files of a dataset URL, in a stable order (partitions sort by date)."""
    root = local_path(url)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise DataError(f"{url}: no such file or directory; check the data URLs in the spec")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_EXTENSIONS[fmt]))
    if not files:
        raise DataError(f"{url}: no {fmt} files ({', '.join(_EXTENSIONS[fmt])}); check data.format")
    return files


def _read_file(path: Path, fmt: str) -> pa.Table:
    try:
        if fmt == "jsonl":
            return pajson.read_json(path)
        if fmt == "csv":
            return pacsv.read_csv(path)
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as {fmt}: {exc}") from None


def read_table(url: str, spec: DataSpec, columns: list[str]) -> pa.Table:
    """Read every file of the dataset and keep `columns`, naming any file that lacks one."""
    tables = []
    for path in data_files(url, spec.format):
        table = _read_file(path, spec.format)
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(
                f"{path}: missing column(s) {missing}; it has {table.column_names}. "
                "Set data.text_field / data.label_field / data.id_field to match the file"
            )
        tables.append(table.select(columns))
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


class HashingTokenizer:
    """Words hashed into a fixed vocabulary: stateless, so ids never shift between runs.

    Id 0 is padding and id 1 the leading [CLS] token, so no sequence is ever empty.
    """

    def __init__(self, vocab_size: int, seq_len: int):
        self.vocab_size, self.seq_len = vocab_size, seq_len

    def ids(self, text: str) -> list[int]:
        buckets = self.vocab_size - 2
        words = _WORD.findall(text.lower())[: self.seq_len - 1]
        return [CLS_ID] + [2 + zlib.crc32(w.encode()) % buckets for w in words]

    def encode(self, texts: list[str]) -> torch.Tensor:
        out = torch.full((len(texts), self.seq_len), PAD_ID, dtype=torch.long)
        for row, text in enumerate(texts):
            ids = self.ids(text or "")
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        return out


@dataclass
class Encoded:
    tokens: torch.Tensor
    labels: torch.Tensor | None
    ids: list


def load_labelled(url: str, spec: DataSpec, tokenizer: HashingTokenizer, num_classes: int) -> Encoded:
    table = read_table(url, spec, [spec.text_field, spec.label_field])
    if table.num_rows == 0:
        raise DataError(f"{url}: has no rows; point the spec at data that has some")
    labels = torch.tensor(table.column(spec.label_field).to_pylist(), dtype=torch.long)
    bad = (labels < 0) | (labels >= num_classes)
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        raise DataError(
            f"{url}: label {int(labels[row])} in row {row} is outside 0..{num_classes - 1}; "
            "fix the data or set model.num_classes"
        )
    tokens = tokenizer.encode([str(t) for t in table.column(spec.text_field).to_pylist()])
    return Encoded(tokens, labels, list(range(len(labels))))


def load_unlabelled(url: str, spec: DataSpec, tokenizer: HashingTokenizer) -> Encoded:
    table = read_table(url, spec, [spec.id_field, spec.text_field])
    tokens = tokenizer.encode([str(t) for t in table.column(spec.text_field).to_pylist()])
    return Encoded(tokens, None, table.column(spec.id_field).to_pylist())


def static_batches(tokens: torch.Tensor, rows: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, int]]:
    """Fixed-shape batches over `rows`: the last one is filled up with placeholder rows, so every
    forward pass has the same shape and nothing recompiles. Yields (tokens, number of real rows)."""
    filler = torch.full((1, tokens.shape[1]), PAD_ID, dtype=tokens.dtype)
    filler[0, 0] = CLS_ID
    for chunk in rows.split(batch_size):
        batch = tokens[chunk]
        if len(chunk) < batch_size:
            batch = torch.cat([batch, filler.expand(batch_size - len(chunk), -1)])
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

    def __init__(self, n_rows: int, global_batch: int, rank: int, world: int, seed: int, drop_last: bool = True):
        if n_rows < global_batch:
            raise DataError(
                f"the training set has {n_rows} rows, fewer than one global batch ({global_batch}); "
                "add data or lower train.global_batch_size"
            )
        self.n, self.global_batch, self.seed = n_rows, global_batch, seed
        self.rank, self.world = rank, world
        self.per_rank = global_batch // world
        full, left = divmod(n_rows, global_batch)
        self.steps_per_epoch = full + (1 if not drop_last and left >= world else 0)
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

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
