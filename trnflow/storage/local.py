"""A directory as a `Store`: atomic writes by temp file, flush to disk and rename; `create` by an
exclusive link."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO

from trnflow.fsutil import atomic_write_bytes, atomic_writer
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

    def open(self, name: str) -> BinaryIO:
        return self._path(name).open("rb")

    def write(self, name: str, data: bytes) -> None:
        atomic_write_bytes(self._path(name), data)

    def writing(self, name: str) -> AbstractContextManager[BinaryIO]:
        return atomic_writer(self._path(name))

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
        """Every file under the prefix, walked with one `scandir` per folder (symlinked folders are not
        entered, as `Path.rglob` does not enter them); a file or folder removed during the walk is left out."""
        base = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._path(base) if base else self.root  # walk only what can match
        found: list[ObjectInfo] = []
        pending = [(str(start), f"{base}/" if base else "")]
        while pending:
            folder, named = pending.pop()
            try:
                with os.scandir(folder) as listing:
                    children = list(listing)
            except (FileNotFoundError, NotADirectoryError):
                continue
            for child in children:
                name = named + child.name
                try:
                    if child.is_dir(follow_symlinks=False):
                        if f"{name}/".startswith(prefix):
                            pending.append((child.path, f"{name}/"))
                    elif name.startswith(prefix) and not name.endswith(".tmp") and child.is_file():
                        stat = child.stat()
                        found.append(ObjectInfo(name, stat.st_size, stat.st_mtime))
                except FileNotFoundError:
                    continue
        found.sort(key=lambda o: o.name)
        return found

    def delete_prefix(self, prefix: str) -> None:
        shutil.rmtree(self._path(prefix), ignore_errors=True)
