"""Atomic local file writes: a reader sees the old file or the new one, never half of either."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from trnflow.errors import DiskFull


@contextlib.contextmanager
def atomic_writer(path: str | Path) -> Iterator[BinaryIO]:
    """A file to write `path` through, a part at a time: once the block ends it is flushed to disk
    and replaces `path` whole; if the block raises, `path` is left as it was and nothing else stays."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"no space left on the device writing {path}: free space there (or write to another "
                           "place) and run again; nothing half-written was left behind, and a training run "
                           "rerun with the same run id resumes from its last committed checkpoint") from exc
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    with atomic_writer(path) as fh:
        fh.write(data)
    return Path(path)


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")
