"""The persistent compile cache on disk, laid out like the Neuron persistent cache:

    <cache>/<compiler version>/MODULE_<graph hash>+<flags hash>/
        model.fx.txt         the canonical graph (what the key was computed from)
        compile_flags.json   the compiler flags
        model.neff           the compiled artifact
        model.done           written last; holds the artifact's sha256 and size
        model.log            instead of model.neff + model.done when compilation failed
        model.lock           while a process compiles the entry (its pid and host)
        usage.json           hit count and last use

A failed entry is remembered: it is not compiled again unless asked (`retry_failed`). A done
entry whose artifact does not match its checksum is reported as corrupt and compiled again,
never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from trnflow.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text

DONE, FAILED, CORRUPT, LOCKED, MISSING = "done", "failed", "corrupt", "locked", "missing"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def lock_owner(entry: Path) -> dict | None:
    """The live process compiling this entry, or None. A lock left by a dead process is stale."""
    lock = entry / "model.lock"
    try:
        owner = json.loads(lock.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if owner.get("host") == socket.gethostname() and not _alive(int(owner.get("pid", -1))):
        return None
    return owner


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def state(entry: Path) -> str:
    if (entry / "model.done").is_file():
        return DONE if verify(entry) else CORRUPT
    if lock_owner(entry) is not None:
        return LOCKED
    if (entry / "model.log").is_file():
        return FAILED
    return MISSING


def verify(entry: Path) -> bool:
    """Whether the artifact is whole: present, of the recorded size and checksum."""
    try:
        record = json.loads((entry / "model.done").read_text())
        data = (entry / "model.neff").read_bytes()
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return len(data) == record.get("bytes") and sha256(data) == record.get("sha256")


class EntryLocked(Exception):
    def __init__(self, entry: Path, owner: dict):
        super().__init__(f"{entry.name} is being compiled by pid {owner.get('pid')} on {owner.get('host')}")
        self.owner = owner


def acquire_lock(entry: Path) -> bool:
    """Take the entry's lock. Returns True when a stale lock (dead holder) had to be cleared.

    Raises EntryLocked when a live process holds it.
    """
    entry.mkdir(parents=True, exist_ok=True)
    lock = entry / "model.lock"
    cleared = False
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            owner = lock_owner(entry)
            if owner is not None:
                raise EntryLocked(entry, owner) from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
            cleared = True
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}, fh)
        return cleared
    raise EntryLocked(entry, {"pid": "?", "host": "?"})


def release_lock(entry: Path) -> None:
    (entry / "model.lock").unlink(missing_ok=True)


def commit(entry: Path, graph_text: str, flags: dict, artifact: bytes) -> None:
    """Write a successful entry; `model.done` goes last."""
    atomic_write_text(entry / "model.fx.txt", graph_text)
    atomic_write_json(entry / "compile_flags.json", flags)
    (entry / "model.log").unlink(missing_ok=True)
    atomic_write_bytes(entry / "model.neff", artifact)
    atomic_write_json(entry / "model.done", {"sha256": sha256(artifact), "bytes": len(artifact)})


def record_failure(entry: Path, graph_text: str, flags: dict, log: str) -> None:
    atomic_write_text(entry / "model.fx.txt", graph_text)
    atomic_write_json(entry / "compile_flags.json", flags)
    atomic_write_text(entry / "model.log", log)


def discard(entry: Path) -> None:
    """Forget a corrupt or failed entry's result so it is compiled again."""
    for name in ("model.done", "model.neff", "model.log"):
        (entry / name).unlink(missing_ok=True)


def record_hit(entry: Path) -> None:
    usage = entry / "usage.json"
    try:
        hits = json.loads(usage.read_text())["hits"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        hits = 0
    atomic_write_json(usage, {"hits": hits + 1, "last_used": time.time()})


@dataclass
class EntryInfo:
    compiler: str
    key: str
    state: str
    bytes: int
    hits: int
    last_used: float | None
    created: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def entries(root: Path) -> list[EntryInfo]:
    out = []
    if not root.is_dir():
        return out
    for version in sorted(p for p in root.iterdir() if p.is_dir()):
        for entry in sorted(p for p in version.iterdir() if p.is_dir() and p.name.startswith("MODULE_")):
            try:
                usage = json.loads((entry / "usage.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                usage = {}
            size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
            out.append(EntryInfo(version.name, entry.name, state(entry), size, usage.get("hits", 0),
                                 usage.get("last_used"), entry.stat().st_mtime))
    return out


def prune(root: Path, current_compiler: str, *, failed: bool = False, older_than_days: float | None = None,
          other_versions: bool = False, dry_run: bool = False) -> list[EntryInfo]:
    """Remove what is asked for; never an entry being compiled (locked)."""
    now, removed = time.time(), []
    for info in entries(root):
        if info.state == LOCKED:
            continue
        last = info.last_used or info.created
        if ((failed and info.state in (FAILED, CORRUPT))
                or (older_than_days is not None and now - last > older_than_days * 86400)
                or (other_versions and info.compiler != current_compiler)):
            removed.append(info)
            if not dry_run:
                shutil.rmtree(root / info.compiler / info.key, ignore_errors=True)
    return removed
