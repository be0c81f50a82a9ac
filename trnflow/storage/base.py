"""Locations named by URL, and the `Store` contract every object store keeps.

Local paths and file:// URLs map straight onto the file system. A `Store` is a prefix under which
objects are read and written whole (or written through a file, a part at a time), by relative name.
Writes are atomic: a reader sees the old object or the new one, never part of either.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from trnflow.errors import FatalError


def local_path(url: str) -> Path:
    """The file-system path of a file:// URL (or plain path)."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path) if parsed.scheme else url)
    raise FatalError(
        f"{url}: the local emulator reads and writes file:// locations only; "
        "use a local path or run with compute.backend sagemaker or batch for s3:// data"
    )


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


@dataclass(frozen=True)
class ObjectInfo:
    name: str
    """Relative to the store's root, with '/' separators."""
    size: int
    modified: float
    """Seconds since the epoch."""


@runtime_checkable
class Store(Protocol):
    url: str

    def read(self, name: str) -> bytes:
        """The object's bytes; FileNotFoundError when there is none."""
        ...

    def open(self, name: str) -> BinaryIO:
        """The object as a seekable file to read a part at a time (a large data file need not fit in
        memory); close it when done. FileNotFoundError when there is none."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Replace the object atomically."""
        ...

    def writing(self, name: str) -> AbstractContextManager[BinaryIO]:
        """A file to write the object through, a part at a time (a large one need not be held in
        memory): it replaces the object whole once the block ends, and if the block raises the
        object stays as it was."""
        ...

    def create(self, name: str, data: bytes) -> bool:
        """Write the object only if it does not exist yet; False when it did. Give it content unique
        to the caller (a token, a time): a retried request tells its own object by it."""
        ...

    def delete(self, name: str) -> None:
        """Remove the object if it exists."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose name starts with `prefix`, sorted by name."""
        ...

    def delete_prefix(self, prefix: str) -> None:
        """Remove every object under `prefix` (a folder name ending in '/')."""
        ...
