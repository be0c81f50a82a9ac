"""Reading datasets: JSONL, Parquet, CSV with a header, and the Amazon Polarity CSV layout (no header;
the columns are label 1 or 2, title and content), streamed a batch at a time.

Which files a dataset holds, and their day partitions, is `trnflow.storage.datafiles`' business.
Which columns are read is the recipe's business (`Recipe.columns`), beside the label and id columns.

A day partition that cannot be read, or has no rows, stops the run with a DataError naming the day
and its files: skipping it would let the watermark pass a day that was never trained on.

torch-free when imported: the readers give pyarrow tables, and only the in-memory readers
(`read_labelled`, `labels_of`) load torch, for their labels tensor. `trnflow data check` reads a set
the same way without stopping (`trnflow.workload.datacheck`); the sampler and the static batches
are `trnflow.workload.sampler`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.json as pajson
import pyarrow.parquet as pq

from trnflow.errors import DataError
from trnflow.specs import DataSpec
from trnflow.storage.datafiles import DataFile, data_files, day_problem

if TYPE_CHECKING:
    import torch  # the labels' type only: torch is loaded by `labels_of`

POLARITY_COLUMNS = ["label", "title", "content"]
BATCH_ROWS = 8192
"""Rows a read hands on at a time: a file of any size is read in batches of at most this many rows."""
BLOCK_BYTES = 1 << 20
"""Bytes of JSONL or CSV read and parsed at a time."""


def _records(handle, quoted: bool) -> Iterator[bytes]:
    """The file's bytes about BLOCK_BYTES at a time, each piece ending at the end of a line that ends a
    record. With `quoted` (CSV), a line break inside a quoted field does not end a record: one that
    follows an even number of '"' since the start of the file does (a quote in a field is doubled)."""
    carry, quotes = b"", 0  # the unfinished record, and the quotes before it
    while block := handle.read(BLOCK_BYTES):
        data, cut = carry + block, len(carry) + len(block)
        while (cut := data.rfind(b"\n", 0, cut)) >= 0:
            if not quoted or (quotes + data.count(b'"', 0, cut)) % 2 == 0:
                break
        if cut < 0:  # no record ends in this block yet
            carry = data
            continue
        if quoted:
            quotes += data.count(b'"', 0, cut + 1)
        yield data[: cut + 1]
        carry = data[cut + 1:]
    if carry.strip():
        yield carry


def _parse(fmt: str, data: bytes) -> pa.Table:
    """One piece of a JSONL or CSV file. Column types are inferred from the piece: a column can be
    empty in one and text in the next, and later steps take either."""
    if fmt == "jsonl":
        return pajson.read_json(pa.BufferReader(data))
    names = POLARITY_COLUMNS if fmt == "amazon-polarity" else None
    # Text that is not UTF-8 stays a string column, refused with the fix in _stream_columns.
    return pacsv.read_csv(pa.BufferReader(data), read_options=pacsv.ReadOptions(column_names=names),
                          convert_options=pacsv.ConvertOptions(check_utf8=False))


def _text_pieces(handle, fmt: str) -> Iterator[pa.Table]:
    """A JSONL or CSV file a piece at a time; a CSV header goes in front of every piece."""
    header = b""
    pieces = _records(handle, quoted=fmt != "jsonl")
    if fmt == "csv":
        header = next(pieces, b"")
        first = header.find(b"\n") + 1 if b"\n" in header else len(header)
        header, rest = header[:first], header[first:]  # the first piece: the header line, then records
        pieces = itertools.chain([rest] if rest else [], pieces)
    empty = True
    for piece in pieces:
        empty = False
        yield _parse(fmt, header + piece)
    if empty:  # the columns of a file with none (or the parser's own words for an empty file)
        yield _parse(fmt, header)


def stream_file(file: DataFile, fmt: str) -> Iterator[pa.Table]:
    """A file's rows, at most BATCH_ROWS at a time and never the whole file in memory. A file without
    rows gives one empty table, so that its columns can still be checked."""
    try:
        with file.store.open(file.name) as handle:
            if fmt == "parquet":
                parquet = pq.ParquetFile(pa.PythonFile(handle, mode="r"))
                tables = (pa.Table.from_batches([b]) for b in parquet.iter_batches(batch_size=BATCH_ROWS))
                empty = parquet.schema_arrow.empty_table()
            else:
                tables, empty = _text_pieces(handle, fmt), None
            rows = False
            for table in tables:
                if not table.num_rows:
                    empty = table if empty is None else empty
                    continue
                rows = True
                for first in range(0, table.num_rows, BATCH_ROWS):
                    yield table.slice(first, BATCH_ROWS)
            if not rows and empty is not None:
                yield empty
    except (pa.ArrowInvalid, OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{file.url}: cannot be read as {fmt} ({exc}); fix or remove the file "
                        "(or check data.format)") from None


def _polarity(table: pa.Table, url: str) -> pa.Table:
    """label 1 (negative) / 2 (positive), title, content -> label 0/1 and text "title. content"."""
    labels = table.column("label")
    if table.num_rows and (not pa.types.is_integer(labels.type)
                           or not pc.all(pc.is_in(labels, pa.array([1, 2]))).as_py()):
        raise DataError(f"{url}: the Amazon Polarity layout needs label 1 or 2 in the first column; "
                        "fix the file or check data.format")
    title = pc.fill_null(table.column("title").cast(pa.string()), "")
    content = pc.fill_null(table.column("content").cast(pa.string()), "")
    return pa.table({"label": pc.subtract(labels.cast(pa.int64()), 1),
                     "text": pc.binary_join_element_wise(title, content, ". ")})


def stream_columns(file: DataFile, spec: DataSpec, columns: list[str]) -> Iterator[tuple[int, pa.Table]]:
    """One file's `columns`, a batch at a time with the file row each starts at; names the file if
    it lacks a column or holds text that is not UTF-8."""
    first = 0
    for table in stream_file(file, spec.format):
        if spec.format == "amazon-polarity":
            table = _polarity(table, file.url)
            ids = [f"{file.name}:{i}" for i in range(first, first + table.num_rows)]
            table = table.rename_columns([spec.label_field, spec.text_field])
            table = table.append_column(spec.id_field, pa.array(ids, pa.string()))
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise DataError(
                f"{file.url}: missing column(s) {missing}; it has {table.column_names}. "
                "Set data.text_field / data.label_field / data.id_field to match the file"
            )
        for name in columns:
            try:
                table.column(name).validate(full=True)
            except pa.ArrowInvalid:
                raise DataError(f"{file.url}: column {name!r} is not valid UTF-8 text; "
                                "re-encode the file as UTF-8") from None
        yield first, table.select(columns)
        first += table.num_rows


class _Agreeing:
    """Column types must agree across files (integers of different widths, and columns of nulls, do
    mix): the first file that disagrees with the ones before it is named."""

    def __init__(self) -> None:
        self.schema: pa.Schema | None = None

    def check(self, file: DataFile, table: pa.Table) -> None:
        if self.schema is None:
            self.schema = table.schema
            return
        try:
            self.schema = pa.unify_schemas([self.schema, table.schema], promote_options="permissive")
        except (pa.ArrowTypeError, pa.ArrowInvalid):
            types = {f.name: str(f.type) for f in table.schema}
            before = {f.name: str(f.type) for f in self.schema}
            raise DataError(f"{file.url}: its column types {types} disagree with {before} in the files "
                            "before it; make the files agree") from None


def _concat(tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables, promote_options="permissive") if len(tables) > 1 else tables[0]


def iter_table(files: list[DataFile], spec: DataSpec, columns: list[str]) -> Iterator[pa.Table]:
    """`files`' `columns`, a batch at a time, naming any file that lacks one. The Amazon Polarity
    layout has no id column: ids are `<file>:<row>`."""
    agreeing = _Agreeing()
    for file in files:
        for _, table in stream_columns(file, spec, columns):
            agreeing.check(file, table)
            yield table


def preload() -> None:
    """Have pyarrow load what it loads the first time it converts Python values (pandas, where it is
    installed: a tenth of a CPU-s with its bytecode compiled, more without), in a process whose
    forked ranks will then read data."""
    pa.array([0])


def _check_labels(column: pa.ChunkedArray, url: str, field: str, num_classes: int, first: int = 0) -> None:
    """One batch's labels must be integer class ids 0..num_classes-1; rows count from 0 in the file,
    whose row `first` the batch starts at."""
    if not pa.types.is_integer(column.type) or column.null_count:
        raise DataError(f"{url}: column {field!r} holds {column.type} values"
                        f"{' with nulls' if column.null_count else ''}; it must hold integer class ids "
                        f"0..{num_classes - 1}. Map the labels to integers, or set data.label_field")
    row = pc.index(pc.or_(pc.less(column, 0), pc.greater_equal(column, num_classes)), True).as_py()
    if row >= 0:
        raise DataError(
            f"{url}: label {column[row].as_py()} in row {first + row} is outside 0..{num_classes - 1}; "
            "fix the data or set the recipe's number of classes (model.params.num_classes)"
        )


def lines(table: pa.Table) -> list[str]:
    """Each row's columns as one line of text (tab-separated), for digests of what was read."""
    columns = [[str(v) for v in table.column(i).to_pylist()] for i in range(table.num_columns)]
    return ["\t".join(values) for values in zip(*columns, strict=True)] if columns else [""] * table.num_rows


@dataclass
class Rows:
    table: pa.Table
    """The recipe's columns."""
    labels: torch.Tensor | None
    ids: list

    def lines(self) -> list[str]:
        return lines(self.table)


def labelled_batches(file: DataFile, spec: DataSpec, columns: list[str], num_classes: int | None
                     ) -> Iterator[pa.Table]:
    """One file's columns and its labels, checked, a batch at a time; DataError names the file.
    `num_classes` None: a recipe whose rows have no labels; no label column is read, and each
    row's label is 0."""
    if num_classes is None:
        for _, table in stream_columns(file, spec, columns):
            yield table.append_column(spec.label_field, pa.array([0] * table.num_rows, pa.int64()))
        return
    for first, table in stream_columns(file, spec, [*columns, spec.label_field]):
        if table.num_rows:  # an empty file's columns may be typed null
            _check_labels(table.column(spec.label_field), file.url, spec.label_field, num_classes, first)
        yield table


def _day_files(files: list[DataFile], day: str) -> list[str]:
    return [f.name for f in files if f.partition == day]


def _day_batches(file: DataFile, files: list[DataFile], url: str, batches: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """`batches` of `file`; a file of a day partition that cannot be read fails naming its day and the day's files."""
    try:
        yield from batches
    except DataError as exc:
        if file.partition is None:
            raise
        raise DataError(day_problem(url, file.partition, _day_files(files, file.partition),
                                    f"cannot be read: {exc}")) from None


def iter_labelled(files: list[DataFile], spec: DataSpec, columns: list[str], num_classes: int | None, url: str
                  ) -> Iterator[pa.Table]:
    """Every row of `files` with its label, a batch at a time (`columns` and then the label column).
    Each day partition must be readable and give rows: an empty day is refused, not passed over,
    once the stream reaches its end."""
    agreeing, rows, total = _Agreeing(), {}, 0
    for file in files:
        for table in _day_batches(file, files, url, labelled_batches(file, spec, columns, num_classes)):
            agreeing.check(file, table)
            if file.partition is not None:
                rows[file.partition] = rows.get(file.partition, 0) + table.num_rows
            total += table.num_rows
            yield table
    empty = sorted(day for day, n in rows.items() if n == 0)
    if empty:
        raise DataError(day_problem(url, empty[0], _day_files(files, empty[0]), "has no rows",
                                    "write the day's rows, or remove its folder"))
    if not total:
        raise DataError(f"{url}: has no rows; point the spec at data that has some")


def labels_of(table: pa.Table, field: str) -> torch.Tensor:
    """A table's labels as the tensor training and evaluation take."""
    import torch  # slow to import: only the readers that hand the workload tensors load it

    return torch.tensor(table.column(field).to_pylist(), dtype=torch.long)


def read_labelled(files: list[DataFile], spec: DataSpec, columns: list[str], num_classes: int | None, url: str
                  ) -> Rows:
    """Every row of `files`, with its label, in memory (a holdout set); `iter_labelled` reads them."""
    table = _concat(list(iter_labelled(files, spec, columns, num_classes, url)))
    labels = labels_of(table, spec.label_field)
    return Rows(table.select(columns), labels, list(range(len(labels))))


def iter_unlabelled(url: str, spec: DataSpec, columns: list[str]) -> Iterator[pa.Table]:
    """The inference set's ids and `columns`, a batch at a time."""
    return iter_table(data_files(url, spec.format), spec, [spec.id_field, *columns])


def read_unlabelled(url: str, spec: DataSpec, columns: list[str]) -> Rows:
    table = _concat(list(iter_unlabelled(url, spec, columns)))
    return Rows(table.select(columns), None, table.column(spec.id_field).to_pylist())
