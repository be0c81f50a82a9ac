"""Tar archives from elsewhere (SageMaker's output.tar.gz, a compile cache entry's artifact) are
read safely. trnflow writes every member itself, never through `tarfile`'s extraction (whose `data`
filter CVE-2025-4517 defeats on the Python releases before its fix): only regular files and
folders, each named by a relative path that stays inside the destination, and no more than a cap
of bytes in all. Every member is checked before the first is written, so a refused archive writes
nothing. Links of any kind are refused: no archive trnflow reads has one. A single file (a job's
`result.json`) is read in memory, without unpacking anything."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from trnflow.errors import FatalError

MAX_BYTES = 8 * 1024**3
"""The most an archive may unpack to (8 GiB): a compile artifact or a job's outputs are far smaller."""


class Refused(Exception):
    """An archive member trnflow does not unpack, and why."""

    def __init__(self, name: str, why: str):
        super().__init__(f"{name!r}: {why}")
        self.name = name


def _relative(member: tarfile.TarInfo) -> PurePosixPath:
    """The member's path inside the destination; Refused when it is not a plain relative path."""
    path = PurePosixPath(member.name)
    if path.is_absolute() or ".." in path.parts or "\\" in member.name:  # a backslash: a Windows path
        raise Refused(member.name, "a path that leaves the folder")
    return path


def checked(archive: tarfile.TarFile, limit: int = MAX_BYTES) -> list[tarfile.TarInfo]:
    """Every member, once each is a regular file or folder with a relative path inside the archive's
    folder and all of them hold at most `limit` bytes; Refused naming the first that is not."""
    members, total = archive.getmembers(), 0
    for member in members:
        _relative(member)
        if not (member.isreg() or member.isdir()):
            raise Refused(member.name, "not a file or folder (links and devices are never unpacked)")
        total += member.size
        if total > limit:
            raise Refused(member.name, f"the archive unpacks to more than {limit:,} bytes")
    return members


def unpack(archive: tarfile.TarFile, dest: Path, limit: int = MAX_BYTES) -> None:
    """Write `archive`'s files and folders under `dest`, once every member passed `checked`."""
    members = checked(archive, limit)
    root = dest.resolve()
    for member in members:
        target = root.joinpath(*_relative(member).parts)
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        source = archive.extractfile(member)
        assert source is not None  # a regular file always has its data
        # A new file renamed over the old one, never the old one rewritten in place: a file of the
        # folder may be loaded (an Inductor kernel's .so, dlopen'ed), and truncating a mapped
        # library discards its relocated pages -- the next call into it crashes (SIGSEGV).
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        os.fchmod(fd, 0o644)
        try:
            with source, os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(source, out)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    dest.mkdir(parents=True, exist_ok=True)


def _opened(data: bytes, source: str):
    try:
        return tarfile.open(fileobj=io.BytesIO(data), mode="r:*")
    except tarfile.TarError as exc:
        raise FatalError(f"{source}: not a readable tar archive ({exc})") from exc


def extract(data: bytes, dest: Path, source: str) -> Path:
    """Unpack the gzipped tar `data` into `dest`; `source` names it in errors."""
    with _opened(data, source) as archive:
        try:
            unpack(archive, dest)
        except Refused as exc:
            raise FatalError(f"{source}: refused to unpack {exc}; trnflow unpacks only files and folders "
                             "inside the archive's own folder") from None
        except tarfile.TarError as exc:
            raise FatalError(f"{source}: not a readable tar archive ({exc})") from exc
    return dest


def read_member(data: bytes, name: str, source: str, limit: int = 64 * 1024**2) -> bytes | None:
    """The regular file `name` of the tar `data`, read in memory (nothing is written); None when the
    archive has no such file. A larger file than `limit` bytes, or one that is not a regular file,
    is refused."""
    with _opened(data, source) as archive:
        member = next((m for m in archive.getmembers() if PurePosixPath(m.name) == PurePosixPath(name)), None)
        if member is None:  # `./result.json` is `result.json`
            return None
        if not member.isreg() or member.size > limit:
            raise FatalError(f"{source}: refused to read {name!r}: not a regular file of at most {limit:,} bytes")
        found = archive.extractfile(member)
        assert found is not None
        with found:
            return found.read()


def pack(path: Path) -> bytes:
    """The files under `path` (no lock files) as a gzipped tar, named relative to it: what a
    compile cache entry holds as its artifact."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for child in sorted(path.rglob("*")):
            if child.is_file() and not child.name.endswith(".lock"):
                tar.add(child, arcname=str(child.relative_to(path)), recursive=False)
    return buf.getvalue()
