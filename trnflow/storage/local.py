"""A directory as a `Store`: atomic writes by temp file and rename, `create` by an exclusive link."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from trnflow.fsutil import atomic_write_bytes
from trnflow.storage.base import ObjectInfo


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
