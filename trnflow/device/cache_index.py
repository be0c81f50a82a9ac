"""A compile cache's index: per version folder, what the last listing read from each entry's small
files, so a listing reads only the entries that changed.

A listing of every entry (`entries`, behind `trnflow cache ls`) reads one listing of the cache and,
per version folder that holds trnflow's entries, one index, `<version folder>/trnflow-index.json`:
what the last listing read from each entry's trnflow.json and usage.json, each with the size and
time of the files it came from. The listing stays the truth: an entry the index does not know, or
whose files are not listed as the index saw them, is read again, and an entry the index knows but
the listing lacks is not listed. Only listings write the index (and a prune drops what it removed
from it); compiles and hits never touch it, so concurrent writers on any number of hosts, on S3
without appends or renames, cannot make it wrong, only out of date, which costs a read again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from trnflow.device.cache_entry import DONE_MARKER, RECORD, RECORDED_NAMES, USAGE, read_json
from trnflow.storage import ObjectInfo, Store

INDEX = "trnflow-index.json"
"""Each version folder's index of what listings read from its entries' small files (see above)."""
INDEXED = (RECORD, DONE_MARKER, USAGE)
"""The files of an entry an index row is read from (model.done holds the old layout's record)."""
INDEX_FORMAT = 2
"""The index's layout: an index in another is read as none (and written again in this one). Format 1
kept each row as a list, [stamp, sizes, hits, last use]; format 2 keeps an `IndexRow`."""
SETTLE_SECONDS = 2.0
"""How much older a file must be than the newest object of a listing before the index keeps what was
read from it. Listed times are coarse (a second on S3, two seconds on some file systems): a rewrite
within that time, at the same size, is listed as the file it replaced. The newest object was written
before the listing began, so a file this much older was rewritten since, if at all, at a later time."""


class IndexRow(BaseModel):
    """One entry's row in its version folder's index: how the listing showed the files the row was
    read from, and what they said."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stamp: tuple[tuple[StrictInt, float] | None, ...] = Field(
        description="per file of INDEXED: its listed size and modification time, or null where there is none")
    sizes: dict[str, StrictInt] | None = Field(
        description="the sizes the entry's record gives its checked files (done entries only)")
    hits: StrictInt = Field(ge=0)
    last_used: float | None = Field(description="when it was last loaded (Unix seconds)")

    @model_validator(mode="after")
    def _one_stamp_per_file(self) -> IndexRow:
        if len(self.stamp) != len(INDEXED):
            raise ValueError(f"stamp: {len(self.stamp)} files, where an entry has {len(INDEXED)} ({INDEXED})")
        if self.sizes is not None and self.sizes.keys() not in RECORDED_NAMES:
            raise ValueError(f"sizes: names {sorted(self.sizes)}, not the files a record covers")
        return self

    @staticmethod
    def stamp_of(listed: dict[str, ObjectInfo]) -> tuple[tuple[int, float] | None, ...]:
        """How a listing shows the files a row is read from (`INDEXED`)."""
        return tuple((listed[name].size, listed[name].modified) if name in listed else None for name in INDEXED)

    def unsettled(self, settled_before: float) -> bool:
        """Whether one of its files was written too recently for the listing to tell a rewrite."""
        return any(seen is not None and seen[1] > settled_before for seen in self.stamp)


def kept_row(value: Any) -> IndexRow | None:
    """An index's row as `IndexRow`; None for one it cannot be (garbled, or hand-edited): the entry's
    files are then read again, which is what the index saves."""
    try:
        return IndexRow.model_validate(value)
    except ValidationError:
        return None


class Index:
    """One version folder's index as a listing uses and renews it: `kept`, the rows it was read with;
    `rows`, what this listing read or took over from it, for the next listing."""

    def __init__(self, kept: dict[str, Any], settled_before: float):
        self.kept = {key: row for key, value in kept.items() if (row := kept_row(value)) is not None}
        self.settled_before = settled_before
        self.rows: dict[str, IndexRow] = {}
        self.unsettled = False
        """Whether a row was left out because its files had not settled (`SETTLE_SECONDS`)."""

    def row(self, key: str, listed: dict[str, ObjectInfo],
            read: Callable[[], tuple[dict[str, int] | None, int, float | None]]) -> IndexRow:
        """An entry's row: as the index kept it while the entry's files are listed as they were then,
        else `read` again (recorded sizes, hits, last use); kept for the next listing once settled."""
        row = self.kept.get(key)
        stamp = IndexRow.stamp_of(listed)
        if row is None or row.stamp != stamp:
            sizes, hits, last_used = read()
            row = IndexRow(stamp=stamp, sizes=sizes, hits=hits, last_used=last_used)
        if row.unsettled(self.settled_before):
            self.unsettled = True
            return row
        self.rows[key] = row
        return row

    def document(self) -> bytes:
        """The index file this listing leaves for the next."""
        entries = {key: row.model_dump(mode="json") for key, row in self.rows.items()}
        return json.dumps({"format": INDEX_FORMAT, "entries": entries}, separators=(",", ":")).encode()


def read_rows(store: Store, version: str) -> dict:
    """The rows of a version folder's index; none when it is missing, garbled or of another format."""
    index = read_json(store, f"{version}/{INDEX}")
    rows = index.get("entries") if index is not None and index.get("format") == INDEX_FORMAT else None
    return rows if isinstance(rows, dict) else {}


def renew(store: Store, version: str, index: Index, exists: bool) -> None:
    """Bring a version folder's index up to date with a listing: write it when the listing read what
    it lacked, or left out a row whose files had not settled (written again, the index is newer than
    they are, and the next listing keeps the row); remove it when the folder holds nothing to index.
    A cache this process may only read keeps the index it has."""
    name = f"{version}/{INDEX}"
    try:
        if index.rows or index.unsettled:
            if index.unsettled or not exists or index.rows != index.kept:
                store.write(name, index.document())
        elif exists:
            store.delete(name)
    except Exception:  # read-only credentials or file system, say: the next listing reads the entries again
        return


def forget(store: Store, version: str, keys: set[str]) -> None:
    """Drop removed entries' rows from a version folder's index, and the index once it has none."""
    index = Index(read_rows(store, version), 0.0)
    index.rows = {key: row for key, row in index.kept.items() if key not in keys}
    renew(store, version, index, exists=True)
