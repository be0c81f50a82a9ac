"""Locations named by URL. Local paths and file:// URLs map straight onto the file system."""

from __future__ import annotations

from pathlib import Path
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
