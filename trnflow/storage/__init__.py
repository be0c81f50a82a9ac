"""The storage room: where trnflow reads and writes objects by URL.

It owns the `Store` contract (read, write, create, exists, delete, list, delete_prefix; writes are
atomic), its implementations for a local directory (`LocalStore`) and an S3 prefix (`S3Store`), and
dataset listing (`datafiles`). It imports only the base modules (errors, fsutil, aws) and specs:
never the device, the emulator, the workload or anything above them.
"""

from __future__ import annotations

from trnflow.storage.base import ObjectInfo, Store, join, local_path
from trnflow.storage.local import LocalStore
from trnflow.storage.s3 import S3Store


def open_store(url: str) -> Store:
    """The store for a file:// or s3:// URL (or a plain path)."""
    if url.startswith("s3://"):
        return S3Store(url)
    return LocalStore(local_path(url))


__all__ = ["LocalStore", "ObjectInfo", "S3Store", "Store", "join", "local_path", "open_store"]
