"""Which files a dataset URL holds, and which day partition each sits in. Torch-free, so a flow can
decide whether there is new data before it launches any job.

A dataset URL (file:// or s3://) names one file or a folder of them; a folder may be partitioned by
day (`dt=YYYY-MM-DD/part-*.parquet`), which is what incremental training reads a window of.

A day is never skipped without a word: a run that passed a day it did not read would move the
watermark past it, and that day would never be trained on. So a listing can also hold the files a
run does not read (`every=True`): files of another format than `data.format` and days not yet
marked ready. `since_watermark` stops at the first day not ready, `checked_days` refuses a day of
files nobody would read, and `training_window` says which watermark a run may record.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass
from typing import Literal

from trnflow.errors import DataError
from trnflow.storage import Store, open_store

EXTENSIONS = {"jsonl": (".jsonl", ".json"), "parquet": (".parquet",), "csv": (".csv",),
              "amazon-polarity": (".csv",)}
_PARTITION = re.compile(r"(?:^|/)dt=([^/]+)/")
SHOWN = 5
"""How many of a day's file names an error message lists."""

Role = Literal["data", "other", "marker"]


@dataclass(frozen=True)
class DataFile:
    store: Store
    name: str
    partition: str | None
    """The day of a `dt=YYYY-MM-DD` folder the file sits in, if any."""
    role: Role = "data"
    """`data`: a file of `data.format`, which runs read. `other`: a file of another format, which no
    run reads; listed so that a day of them fails instead of vanishing. `marker`: the ready marker of
    a day that holds no other file (a day marked complete but empty)."""
    ready: bool = True
    """False for a file in a day folder without `data.ready_marker`: a day still being written."""

    @property
    def url(self) -> str:
        return f"{self.store.url}/{self.name}"


@dataclass(frozen=True)
class Window:
    """What a new training run reads, and the watermark it may record."""

    files: list[DataFile]
    """The `data` files of the days (and unpartitioned files) the run reads."""
    watermark: str | None
    """The newest day the run reads such that no day between the parent's watermark and it is left
    unread; the parent's watermark when it reads none."""


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


def _hidden(name: str) -> bool:
    """Markers, checksums and tools' bookkeeping (`_SUCCESS`, `.part-0.parquet.crc`): never data."""
    return name.rsplit("/", 1)[-1].startswith((".", "_"))


def _classify(store: Store, names: list[str], url: str, fmt: str, ready_marker: str | None) -> list[DataFile]:
    """Every file of a listing a run must account for, with its role and day; a day's readiness is
    set by the caller."""
    extensions = EXTENSIONS[fmt]
    files = []
    for name in names:
        base = name.rsplit("/", 1)[-1]
        if _hidden(name) or base == ready_marker:
            continue
        role: Role = "data" if base.endswith(extensions) else "other"
        files.append(DataFile(store, name, _partition(name, url), role))
    return files


def _with_readiness(store: Store, files: list[DataFile], names: list[str], ready_marker: str, url: str
                    ) -> list[DataFile]:
    """`files` with `ready` set by the marker in each day's own folder (the day's files may be nested
    below it), plus a `marker` entry for each day marked ready that holds nothing else."""
    markers = [n for n in names if n.rpartition("/")[2] == ready_marker and _PARTITION.search(n)]
    marked = {n.rpartition("/")[0]: n for n in markers if _day_folder(n) == n.rpartition("/")[0]}
    out = [f if f.partition is None else DataFile(f.store, f.name, f.partition, f.role, _day_folder(f.name) in marked)
           for f in files]
    held = {_day_folder(f.name) for f in files if f.partition is not None}
    out += [DataFile(store, name, _partition(name, url), "marker") for folder, name in marked.items()
            if folder not in held]
    return out


def data_files(url: str, fmt: str, ready_marker: str | None = None, every: bool = False) -> list[DataFile]:
    """The files of a dataset URL, in a stable order (partitions sort by day). With `ready_marker`,
    a `dt=` partition counts only once that file is in its folder (one still being written is
    left for a later run); files outside partitions are unaffected.

    By default only the files a run reads are listed. `every=True` lists, besides them, files of
    another format and days not marked ready (see `DataFile.role` and `ready`), for the callers that
    must not let such a day pass unnoticed."""
    extensions = EXTENSIONS[fmt]
    base, _, last = url.rstrip("/").rpartition("/")
    if last.endswith(extensions):  # one file
        store = open_store(base)
        if last not in {o.name for o in store.list(last)}:
            raise DataError(f"{url}: no such file; check the data URLs in the spec")
        return [DataFile(store, last, None)]
    store = open_store(url)
    names = [o.name for o in store.list()]
    files = _classify(store, names, url, fmt, ready_marker)
    if not any(f.role == "data" for f in files):
        raise DataError(f"{url}: {_nothing_to_read(names, files, fmt)}; "
                        "check the data URLs and data.format in the spec")
    if ready_marker:
        files = _with_readiness(store, files, names, ready_marker, url)
    if not every:
        files = [f for f in files if f.role == "data" and f.ready]
    return sorted(files, key=lambda f: (f.partition or "", f.name))


def _nothing_to_read(names: list[str], files: list[DataFile], fmt: str) -> str:
    if not names:
        return "no such folder, or it is empty"
    found = f", only {_shown([f.name for f in files])}" if files else ""
    return f"no {fmt} files ({', '.join(EXTENSIONS[fmt])}){found}"


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def partitions(files: list[DataFile]) -> list[str]:
    return sorted({f.partition for f in files if f.partition})


def first_waiting(files: list[DataFile]) -> str | None:
    """The first day among `files` not marked ready yet: no later day may be read before it."""
    return min((f.partition for f in files if f.partition and not f.ready), default=None)


def since_watermark(files: list[DataFile], watermark: str | None, url: str) -> list[DataFile]:
    """The files of partitions after `watermark` (all of them when there is no watermark yet), up to
    the first day not marked ready: the days after it wait for it, so that the watermark a run
    records never passes a day it did not read."""
    unpartitioned = [f.name for f in files if f.partition is None and f.role == "data"]
    if unpartitioned:
        raise DataError(f"{url}: data.window since-watermark needs every file in a dt=YYYY-MM-DD folder, "
                        f"but {unpartitioned[0]} is not; partition the data or set data.window: all")
    after = [f for f in files if f.partition is not None and (watermark is None or f.partition > watermark)]
    waiting = first_waiting(after)
    return [f for f in after if waiting is None or f.partition < waiting]


def day_problem(url: str, day: str, files: list[str], why: str, fix: str = "") -> str:
    """The message for a day a run cannot read: the dataset, the day, its files, why and the fix. The
    run stops rather than skip it, since a skipped day would never be trained on."""
    return (f"{url}: day dt={day} ({_shown(files)}) {why}{'; ' + fix if fix else ''}. The run stops rather than "
            "skip the day, which would let the watermark pass it unread")


def _extensions(names: list[str]) -> str:
    found = sorted({"." + n.rsplit(".", 1)[-1] if "." in n.rsplit("/", 1)[-1] else "extension-less" for n in names})
    return ", ".join(found)


def checked_days(files: list[DataFile], fmt: str, url: str) -> list[DataFile]:
    """The `data` files of `files`, once every day among them holds files of `fmt` and nothing a run
    would leave unread; DataError names the first day that does not."""
    for day in partitions(files):
        mine = [f for f in files if f.partition == day]
        names = [f.name for f in mine]
        others = [f.name for f in mine if f.role == "other"]
        if not any(f.role == "data" for f in mine):
            why = (f"holds no {fmt} files (data.format), only {_extensions(others)} files" if others
                   else f"is marked ready by {names[0].rsplit('/', 1)[-1]} but holds no {fmt} files")
            raise DataError(day_problem(url, day, names, why, f"write the day as {fmt}, or remove its folder"))
        if others:
            it, are = ("it", "is") if len(others) == 1 else ("them", "are")
            why = f"holds {_shown(others)}, which {are} not {fmt} (data.format)"
            fix = f"rewrite {it} as {fmt}, or move {it} out of the day's folder"
            raise DataError(day_problem(url, day, names, why, fix))
    return [f for f in files if f.role == "data"]


def training_window(files: list[DataFile], window: str, watermark: str | None, url: str, fmt: str) -> Window:
    """What a new run reads from `files` (a `data_files(..., every=True)` listing) under
    `data.window`, starting from a checkpoint with `watermark`; DataError when a day it would read
    holds nothing readable. With `window: all`, days not ready yet are left out, and the watermark
    stops before the first of them."""
    chosen = since_watermark(files, watermark, url) if window == "since-watermark" else [f for f in files if f.ready]
    read = checked_days(chosen, fmt, url)
    waiting = first_waiting([f for f in files if watermark is None or (f.partition or "") > watermark])
    days = [d for d in partitions(read) if waiting is None or d < waiting]
    return Window(read, max([watermark or "", *days]) or None)


def check_new_days(url: str, fmt: str, watermark: str | None, ready_marker: str | None = None) -> None:
    """DataError naming the first day after `watermark` that holds nothing a run could read: found
    from the listing, before a run launches any job for it."""
    checked_days(since_watermark(data_files(url, fmt, ready_marker, every=True), watermark, url), fmt, url)


def new_partitions(url: str, fmt: str, watermark: str | None, ready_marker: str | None = None) -> list[str]:
    """The day partitions of a dataset after `watermark`: what an incremental run would read. A day
    of files in another format is listed too, so the run that reads it fails naming it rather
    than the day being passed over."""
    return partitions(since_watermark(data_files(url, fmt, ready_marker, every=True), watermark, url))


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """What listing a location raises when it cannot be reached at all (no credentials, no access,
    no network, no permission), as opposed to data that is wrong."""
    try:
        from botocore.exceptions import BotoCoreError, ClientError  # lazily: only S3 locations need it
    except ModuleNotFoundError:
        return (OSError,)
    return (OSError, BotoCoreError, ClientError)


def cannot_list(url: str, exc: BaseException) -> str:
    return (f"{url}: cannot be listed ({type(exc).__name__}: {exc}); check the URL, and that this machine can "
            "reach it (for s3://, AWS credentials allowed to list it)")


def listing_problems(url: str, fmt: str, ready_marker: str | None = None) -> list[str]:
    """What the listing of a data location shows wrong, without reading a row: it is missing or
    cannot be listed, it holds no files of `fmt`, or a day of it holds files no run would read.
    Each message starts with the URL."""
    try:
        files = data_files(url, fmt, ready_marker, every=True)
    except DataError as exc:
        return [str(exc)]
    except unreachable_errors() as exc:
        return [cannot_list(url, exc)]
    problems = []
    for day in partitions(files):
        try:
            checked_days([f for f in files if f.partition == day and f.ready], fmt, url)
        except DataError as exc:
            problems.append(str(exc))
    return problems
