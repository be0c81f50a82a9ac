"""Tar archives from elsewhere (SageMaker's output.tar.gz) are unpacked safely: no absolute
paths, no `..`, no links leaving the folder, no devices. Absolute names are refused here; the
standard library's `data` filter refuses the rest."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from trnflow.errors import FatalError


def extract(data: bytes, dest: Path, source: str) -> Path:
    """Unpack the gzipped tar `data` into `dest`; `source` names it in errors."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as archive:
            for member in archive.getmembers():  # the data filter would only strip the leading '/'
                if member.name.startswith(("/", "\\")):
                    raise FatalError(f"{source}: refused to unpack {member.name!r}: an absolute path; the "
                                     "archive tries to write outside its folder")
            archive.extractall(dest, filter="data")
    except tarfile.FilterError as exc:
        raise FatalError(f"{source}: refused to unpack {exc.tarinfo.name!r}: {exc}; the archive tries to "
                         "write outside its folder") from exc
    except tarfile.TarError as exc:
        raise FatalError(f"{source}: not a readable tar archive ({exc})") from exc
    return dest
