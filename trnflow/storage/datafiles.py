"""Which files a dataset URL holds, and which day partition each sits in. Torch-free, so a flow can
decide whether there is new data before it launches any job.

A dataset URL (file:// or s3://) names one file or a folder of them; a folder may be partitioned by
day (`dt=YYYY-MM-DD/part-*.parquet`), which is what incremental training reads a window of.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

from trnflow.errors import DataError
from trnflow.storage import Store, open_store

EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "csv": (".csv",),
              "amazon-polarity": (".csv",)}
_PARTITION = re.compile(r"(?:^|/)dt=([^/]+)/")


@dataclass(frozen=True)
class DataFile:
    store: Store
    name: str
    partition: str | None
    """The day of a `dt=YYYY-MM-DD` folder the file sits in, if any."""

    @property
    def url(self) -> str:
        return f"{self.store.url}/{self.name}"


def _partition(name: str, url: str) -> str | None:
    match = _PARTITION.search(name)
    if not match:
        return None
    try:
        return dt.date.fromisoformat(match.group(1)).isoformat()
    except ValueError:
        raise DataError(f"{url}/{name}: partition folder dt={match.group(1)} is not a date; "
                        "name partitions dt=YYYY-MM-DD") from None


def _day_folder(name: str) -> str:
    """`a/dt=2026-01-03/region=eu/part-1.parquet` -> `a/dt=2026-01-03`."""
    match = _PARTITION.search(name)
    assert match is not None
    return name[:match.end() - 1]


def data_files(url: str, fmt: str, ready_marker: str | None = None) -> list[DataFile]:
    """The files of a dataset URL, in a stable order (partitions sort by day). With `ready_marker`,
    a `dt=` partition counts only once that file is in its folder (one still being written is
    left for a later run); files outside partitions are unaffected."""
    extensions = EXTENSIONS[fmt]
    base, _, last = url.rstrip("/").rpartition("/")
    if last.endswith(extensions):  # one file
        store = open_store(base)
        if last not in {o.name for o in store.list(last)}:
            raise DataError(f"{url}: no such file; check the data URLs in the spec")
        return [DataFile(store, last, None)]
    store = open_store(url)
    listed = store.list()
    names = [o.name for o in listed if o.name.endswith(extensions) and not o.name.rsplit("/", 1)[-1].startswith(".")]
    if not names:
        what = "no such folder, or it is empty" if not listed else f"no {fmt} files ({', '.join(extensions)})"
        raise DataError(f"{url}: {what}; check the data URLs and data.format in the spec")
    files = [DataFile(store, n, _partition(n, url)) for n in names]
    if ready_marker:  # the marker sits in the day's own folder; the day's files may be nested below it
        ready = {o.name.rpartition("/")[0] for o in listed if o.name.rpartition("/")[2] == ready_marker}
        files = [f for f in files if f.partition is None or _day_folder(f.name) in ready]
    return sorted(files, key=lambda f: (f.partition or "", f.name))


def partitions(files: list[DataFile]) -> list[str]:
    return sorted({f.partition for f in files if f.partition})


def since_watermark(files: list[DataFile], watermark: str | None, url: str) -> list[DataFile]:
    """The files of partitions after `watermark` (all of them when there is no watermark yet)."""
    unpartitioned = [f.name for f in files if f.partition is None]
    if unpartitioned:
        raise DataError(f"{url}: data.window since-watermark needs every file in a dt=YYYY-MM-DD folder, "
                        f"but {unpartitioned[0]} is not; partition the data or set data.window: all")
    return [f for f in files if watermark is None or f.partition > watermark]


def new_partitions(url: str, fmt: str, watermark: str | None, ready_marker: str | None = None) -> list[str]:
    """The day partitions of a dataset after `watermark`: what an incremental run would read."""
    return partitions(since_watermark(data_files(url, fmt, ready_marker), watermark, url))
