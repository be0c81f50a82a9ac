"""`trnflow data check`: how runs read each of a spec's data sets, without stopping on what a run
would stop on. One part per training day and per set: files, rows read, rows rejected and why.

It reads each file as the runs do (`trnflow.workload.data`) and loads no torch, so the check starts
quickly wherever the spec's data is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import pyarrow as pa

from trnflow.errors import DataError, FatalError
from trnflow.results import DataFileCheck, DataPartCheck
from trnflow.specs import DataSpec
from trnflow.storage.datafiles import (
    EXTENSIONS,
    DataFile,
    cannot_list,
    data_files,
    first_waiting,
    partitions,
    unreachable_errors,
)
from trnflow.workload.data import labelled_batches, stream_columns, stream_file
from trnflow.workload.windows import FirstFit


@dataclass(frozen=True)
class Tokens:
    """How a recipe whose rows are tokens sees a batch: each row's tokens, whole (its
    `token_lengths`: None before its tokenizer is known), the model's input length (`seq_len`),
    and whether training packs the rows (`data.packing`)."""

    lengths: Callable[[pa.Table], list[int] | None]
    seq_len: int
    packing: bool = False


def _format_of(name: str) -> str | None:
    """The format a file's extension says it is in (csv for .csv), if any."""
    return next((fmt for fmt, ext in EXTENSIONS.items() if name.endswith(ext)), None)


def _count_rows(file: DataFile, fmt: str | None) -> int | None:
    """How many rows a rejected file holds, when it can be read at all as `fmt`."""
    try:
        return sum(table.num_rows for table in stream_file(file, fmt)) if fmt else None
    except DataError:
        return None


def _own_words(message: str, file: DataFile) -> str:
    return message.removeprefix(f"{file.url}: ")


def _check_file(file: DataFile, spec: DataSpec, columns: list[str], num_classes: int | bool | None,
                tokens: Tokens | None = None, packed: FirstFit | None = None) -> DataFileCheck:
    """One file read as a run reads it: `num_classes` False, unlabelled as inference reads it (with
    its ids); None, as a recipe without labels trains on it; else with labels 0..num_classes-1.
    With `tokens`, the rows cut to the model's input are counted, and with `packed`, each row
    (cut) is placed in it as training packs it."""
    if file.role == "other":
        return DataFileCheck(name=file.name, rows_rejected=_count_rows(file, _format_of(file.name)),
                             problem=f"not {spec.format} (data.format), so no run reads it")
    read = cut = 0
    try:
        if num_classes is False:
            tables: Iterator[pa.Table] = (t for _, t in stream_columns(file, spec, [spec.id_field, *columns]))
        else:
            tables = labelled_batches(file, spec, columns, num_classes)
        for table in tables:
            read += table.num_rows
            lengths = tokens.lengths(table) if tokens is not None else None
            if tokens is None or lengths is None:
                continue
            cut += sum(n > tokens.seq_len for n in lengths)
            if packed is not None:
                for n in filter(None, lengths):  # a row with no tokens is not packed
                    packed.place(min(n, tokens.seq_len))
    except (DataError, FatalError) as exc:
        return DataFileCheck(name=file.name, rows_rejected=_count_rows(file, spec.format),
                             problem=_own_words(str(exc), file))
    return DataFileCheck(name=file.name, rows_read=read, rows_cut=cut)


def _check_part(field: str, url: str, day: str | None, files: list[DataFile], spec: DataSpec, columns: list[str],
                num_classes: int | bool | None, waiting: str | None, tokens: Tokens | None = None) -> DataPartCheck:
    """A day (or a set's files outside day folders): read, rejected, and whether a run could read it;
    packed as training packs it, with `tokens` that say so (the training set's)."""
    part = {"field": field, "url": url, "day": day}
    if any(not f.ready for f in files):
        return DataPartCheck(**part, state="waiting", problems=[f"not marked ready by {spec.ready_marker} yet, "
                                                                  "so not read; the watermark stays before it"])
    packed = FirstFit(tokens.seq_len) if tokens is not None and tokens.packing else None
    checked = [_check_file(f, spec, columns, num_classes, tokens, packed) for f in files if f.role != "marker"]
    read, rejected = sum(c.rows_read for c in checked), sum(c.rows_rejected or 0 for c in checked)
    ignored = {f.name for f in files if f.role == "other"} if day is None else set()  # runs leave these be
    problems = [f"{c.name}: {c.problem}" for c in checked if c.problem and c.name not in ignored]
    notes = [f"{c.name}: {c.problem}" for c in checked if c.name in ignored]
    if not read and (day is not None or len(ignored) < len(checked)):
        problems.append("no readable rows" + (f" in {spec.format}" if any(f.role == "other" for f in files) else ""))
    if day is not None and waiting is not None and day > waiting:
        notes.append(f"read once dt={waiting} is ready")
    if cut := sum(c.rows_cut for c in checked):
        notes.append(f"{cut} row(s) longer than the model's input, cut to it (raise model.params.seq_len to keep them "
                     "whole)")
    fill = packed.fill() if packed is not None and packed.rows else None
    if fill is not None:
        notes.append(f"data.packing: {fill} (one row a window: {fill.unpacked:.1%})")
    elif packed is not None and read:
        notes.append("data.packing: how full the windows are is known once the tokenizer is trained on the data (the "
                     "run's log says it)")
    return DataPartCheck(**part, state="failed" if problems else "ok", files=checked, rows_read=read,
                         rows_rejected=rejected, problems=problems, notes=notes, packing=fill)


def check_set(field: str, url: str, spec: DataSpec, columns: list[str], num_classes: int | bool | None,
              ready_marker: str | None = None, tokens: Tokens | None = None) -> list[DataPartCheck]:
    """How runs read the set at `url` (the spec's `field`), one part per day partition and one for
    the files outside day folders: rows read, rows rejected and why. What a run would stop on is a
    part in state `failed`; this never raises for the data itself."""
    try:
        files = data_files(url, spec.format, ready_marker, every=True)
    except DataError as exc:
        return [DataPartCheck(field=field, url=url, state="failed", problems=[str(exc)])]
    except unreachable_errors() as exc:
        return [DataPartCheck(field=field, url=url, state="failed", problems=[cannot_list(url, exc)])]
    waiting = first_waiting(files)
    groups = [(day, [f for f in files if f.partition == day]) for day in [None, *partitions(files)]]
    return [_check_part(field, url, day, mine, spec, columns, num_classes, waiting, tokens)
            for day, mine in groups if mine]


def check_data(spec: DataSpec, columns: list[str], num_classes: int | None, tokens: Tokens | None = None
               ) -> list[DataPartCheck]:
    """Every data set of a spec, as `check_set` reads it: training days (packed as training packs
    them, when it does), holdout, inference."""
    alone = replace(tokens, packing=False) if tokens is not None else None  # only training packs
    return [*check_set("data.train", spec.train, spec, columns, num_classes, spec.ready_marker, tokens),
            *check_set("data.holdout", spec.holdout, spec, columns, num_classes, tokens=alone),
            *check_set("data.inference", spec.inference, spec, columns, False, tokens=alone)]
