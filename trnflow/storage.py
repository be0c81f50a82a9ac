"""Locations named by URL, and the small object-store interface over them.

Local paths and file:// URLs map straight onto the file system. A `Store` is a prefix under which
objects are read and written whole, by relative name: `LocalStore` for a directory, `S3Store`
(`trnflow.s3store`) for `s3://bucket/prefix`. Writes are atomic in both: a reader sees the old
object or the new one, never part of either.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlparse

from trnflow.errors import FatalError
from trnflow.fsutil import atomic_write_bytes


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

    def write(self, name: str, data: bytes) -> None:
        """Replace the object atomically."""
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


class LocalStore:
    """A directory as a store."""

    def __init__(self, root: Path):
        self.root = root
        self.url = root.as_uri()

    def _path(self, name: str) -> Path:
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root.resolve()):
            raise ValueError(f"{name!r} is outside the store {self.url}")
        return path

    def read(self, name: str) -> bytes:
        return self._path(name).read_bytes()

    def write(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self._path(name), data)

    def create(self, name: str, data: bytes) -> bool:
        """The content is written to a temporary file first and linked into place, so a reader never
        sees the object empty."""
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        folder = self._path(prefix.rsplit("/", 1)[0]) if "/" in prefix else self.root  # walk only what can match
        if not folder.is_dir():
            return []
        found = []
        for path in folder.rglob("*"):
            name = path.relative_to(self.root).as_posix()
            if name.startswith(prefix) and path.is_file() and not path.name.endswith(".tmp"):
                stat = path.stat()
                found.append(ObjectInfo(name, stat.st_size, stat.st_mtime))
        return sorted(found, key=lambda o: o.name)

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)


def open_store(url: str) -> Store:
    """The store for a file:// or s3:// URL (or a plain path)."""
    if url.startswith("s3://"):
        from trnflow.s3store import S3Store

        return S3Store(url)
    return LocalStore(local_path(url))
