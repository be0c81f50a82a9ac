"""Tar archives from elsewhere (SageMaker's output.tar.gz) are unpacked safely: no absolute
paths, no `..`, no links leaving the folder, no devices. Absolute names are refused here; the
standard library's `data` filter refuses the rest. Every member is checked before the first is
written; a chain of links that only resolves outside once earlier members exist is still refused,
during extraction."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from trnflow.errors import FatalError


def unpack(archive: tarfile.TarFile, dest: Path) -> None:
    """Extract `archive` into `dest` once every member has been checked, so that an unsafe member
    is refused before anything is written (a link chain that only leaves `dest` once extracted is
    refused midway). Raises tarfile.FilterError naming the first unsafe member."""
    for member in archive.getmembers():
        if member.name.startswith(("/", "\\")):  # the data filter would only strip the leading '/'
            raise tarfile.AbsolutePathError(member)
        tarfile.data_filter(member, str(dest))
    dest.mkdir(parents=True, exist_ok=True)
    archive.extractall(dest, filter="data")


def extract(data: bytes, dest: Path, source: str) -> Path:
    """Unpack the gzipped tar `data` into `dest`; `source` names it in errors."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            unpack(archive, dest)
    except tarfile.FilterError as exc:
        raise FatalError(f"{source}: refused to unpack {exc.tarinfo.name!r}: {exc}; the archive tries to "
                         "write outside its folder") from exc
    except tarfile.TarError as exc:
        raise FatalError(f"{source}: not a readable tar archive ({exc})") from exc
    return dest


def pack(path: Path) -> bytes:
    """The files under `path` (no lock files) as a gzipped tar, named relative to it: what a
    compile cache entry holds as its artifact."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for child in sorted(path.rglob("*")):
            if child.is_file() and not child.name.endswith(".lock"):
                tar.add(child, arcname=str(child.relative_to(path)), recursive=False)
    return buf.getvalue()
