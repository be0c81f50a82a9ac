"""The persistent compile cache, laid out like the Neuron persistent cache, in a directory or on S3:

    <cache>/<compiler version>/MODULE_<graph hash>+<flags hash>/
        model.fx.txt         the canonical graph (what the key was computed from)
        compile_flags.json   the compiler flags
        model.neff           the compiled artifact
        model.done           written last; the sha256 and size of the three files above
        model.log            instead of model.neff + model.done when compilation failed
        model.lock           while a process compiles the entry (its pid, host and start time)
        usage.json           hit count and last use

A failed entry is remembered: it is not compiled again unless asked (`retry_failed`). A done
entry whose files do not match their checksums is reported as corrupt and compiled again, never
loaded. Entries are named `<compiler version>/<key>` in this module's functions.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import tarfile
import time
import uuid
import zlib
from dataclasses import dataclass
from importlib import metadata

from trnflow.errors import FatalError
from trnflow.storage import ObjectInfo, Store, join, open_store

COMPILER_VERSION = f"torch-{metadata.version('torch')}"
"""The compiler version entries are filed under: the torch version stands for neuronx-cc's."""
DONE, FAILED, CORRUPT, LOCKED, MISSING = "done", "failed", "corrupt", "locked", "missing"
CHECKED_FILES = ("model.fx.txt", "compile_flags.json", "model.neff")
STALE_LOCK_SECONDS = 24 * 3600.0
"""A lock held this long by a process on another host is taken for abandoned."""


def _not_an_archive(data: bytes) -> str | None:
    """Why an artifact is not a readable gzipped tar, or None when it is."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.getmembers()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        return str(exc) or type(exc).__name__
    return None


def entry_name(key: str) -> str:
    """Where a key lives in the cache: `<compiler version>/<key>`."""
    return f"{COMPILER_VERSION}/{key}"


def module_key(graph_hash: str, flags: dict) -> str:
    """`MODULE_<graph hash>+<flags hash>`, as the Neuron cache names its entries."""
    flags_hash = hashlib.md5(json.dumps(flags, sort_keys=True).encode(), usedforsecurity=False).hexdigest()[:8]
    return f"MODULE_{graph_hash}+{flags_hash}"


def miss_reason(cache: CompileCache | None, entry: str) -> str:
    """Why a graph's entry could not be used, as a recompilation report says it."""
    try:
        state = cache.state(entry) if cache else MISSING
    except FatalError as exc:  # a garbled lock record: the graph is compiled here all the same
        return str(exc)
    return {CORRUPT: "the cache entry is corrupt (a file is missing or not as model.done says)",
            FAILED: "its ahead-of-time compile failed",
            LOCKED: "it is still being compiled"}.get(state, "it is not in the compile cache")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class EntryLocked(Exception):
    def __init__(self, entry: str, owner: dict):
        super().__init__(f"{entry} is being compiled by pid {owner.get('pid')} on {owner.get('host')}")
        self.owner = owner


class CorruptEntry(Exception):
    """A done entry whose files do not match their recorded checksums."""


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


class CompileCache:
    """One compile cache, by URL (`file://`, a path, or `s3://bucket/prefix`)."""

    def __init__(self, url: str, store: Store | None = None):
        self.store = store or open_store(url)
        self.url = self.store.url
        self._token = uuid.uuid4().hex

    def where(self, name: str = "") -> str:
        """Where a cache object is, as a person writes it: a path for a local cache, else its URL."""
        root = getattr(self.store, "root", None)
        if root is not None:
            return str(root / name)
        return join(self.url, name) if name else self.url

    # -- state -----------------------------------------------------------------------------------

    def _json(self, name: str) -> dict | None:
        try:
            value = json.loads(self.store.read(name))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            return None
        return value if isinstance(value, dict) else None

    def lock_owner(self, entry: str) -> dict | None:
        """The live process compiling this entry, or None. A lock whose process is gone is stale.

        Raises FatalError for a lock record whose pid or start time is not a number."""
        owner = self._json(f"{entry}/model.lock")
        if owner is None:
            return None
        try:
            pid, since = int(owner.get("pid", -1)), float(owner.get("since", 0))
        except (TypeError, ValueError):
            raise FatalError(f"{self.where(f'{entry}/model.lock')}: a garbled lock record (pid "
                             f"{owner.get('pid')!r}, since {owner.get('since')!r}); trnflow did not write it "
                             "this way and no compile holds it: remove that file") from None
        if owner.get("host") == socket.gethostname():
            return owner if _alive(pid) else None
        return owner if time.time() - since < STALE_LOCK_SECONDS else None

    def state(self, entry: str, deep: bool = False, listed: list[ObjectInfo] | None = None) -> str:
        """The entry's state from its metadata: which files it has, and whether their sizes are the
        ones model.done records. `deep` also checks every file's checksum and that the artifact is
        an archive, which reads the artifact (`cache verify` and a compile do; a listing never does).
        `listed` is the entry's objects when the caller has listed them already."""
        listed = self.store.list(f"{entry}/") if listed is None else listed
        sizes = {o.name.rsplit("/", 1)[-1]: o.size for o in listed}
        if "model.done" in sizes:
            whole = self.verify(entry) if deep else self._sizes_match(entry, sizes)
            return DONE if whole else CORRUPT
        if "model.lock" in sizes and self.lock_owner(entry) is not None:
            return LOCKED
        return FAILED if "model.log" in sizes else MISSING

    def _sizes_match(self, entry: str, sizes: dict[str, int]) -> bool:
        """Whether every checked file is listed at the size model.done records (no file is read)."""
        files = (self._json(f"{entry}/model.done") or {}).get("files")
        return isinstance(files, dict) and all(
            isinstance(files.get(name), dict) and sizes.get(name) == files[name].get("bytes") for name in CHECKED_FILES)

    def verify(self, entry: str) -> bool:
        """Whether every checked file is present, of its recorded size and checksum."""
        return self.problem(entry) is None

    def problem(self, entry: str) -> str | None:
        """Why a done entry is corrupt, or None when it is whole."""
        try:
            artifact = self._verified(entry, "model.neff")
        except CorruptEntry as exc:
            return str(exc)
        why = _not_an_archive(artifact)  # checksummed as it was written; a load finds out as it unpacks
        return f"{entry}/model.neff matches its checksum but is no archive ({why})" if why else None

    def _verified(self, entry: str, wanted: str) -> bytes:
        record = self._json(f"{entry}/model.done") or {}
        files, out = record.get("files"), b""
        if not isinstance(files, dict) or not all(isinstance(files.get(n), dict) for n in CHECKED_FILES):
            raise CorruptEntry(f"{entry}/model.done is missing, unreadable or not a checksum record")
        for name in CHECKED_FILES:
            try:
                data = self.store.read(f"{entry}/{name}")
            except FileNotFoundError:
                raise CorruptEntry(f"{entry}/{name} is missing") from None
            expected = files[name]
            if len(data) != expected.get("bytes") or sha256(data) != expected.get("sha256"):
                raise CorruptEntry(f"{entry}/{name} does not match its checksum in model.done")
            if name == wanted:
                out = data
        return out

    def load_artifact(self, entry: str) -> bytes:
        """The compiled artifact, checked against its checksum first (CorruptEntry if it fails)."""
        return self._verified(entry, "model.neff")

    def failure_log(self, entry: str) -> str:
        try:
            return self.store.read(f"{entry}/model.log").decode(errors="replace")
        except FileNotFoundError:
            return ""

    # -- locks -----------------------------------------------------------------------------------

    def acquire_lock(self, entry: str) -> bool:
        """Take the entry's lock. Returns True when a stale lock (dead holder) had to be cleared.

        Raises EntryLocked when a live process holds it.
        """
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                             "token": self._token}).encode()
        cleared = False
        for _ in range(3):
            if self.store.create(f"{entry}/model.lock", record):
                return cleared
            try:
                owner = self.lock_owner(entry)
            except FatalError:  # garbled: no live compile holds it
                owner = None
            if owner is not None:
                raise EntryLocked(entry, owner)
            self.store.delete(f"{entry}/model.lock")  # stale: its process is gone (or it is garbled)
            cleared = True
        raise EntryLocked(entry, {"pid": "?", "host": "?"})

    def release_lock(self, entry: str) -> None:
        owner = self._json(f"{entry}/model.lock")
        if owner is not None and owner.get("token") == self._token:
            self.store.delete(f"{entry}/model.lock")

    # -- writes ----------------------------------------------------------------------------------

    def commit(self, entry: str, graph_text: str, flags: dict, artifact: bytes, seconds: float = 0.0) -> None:
        """Write a successful entry; `model.done`, with every file's checksum, goes last."""
        files = {"model.fx.txt": graph_text.encode(),
                 "compile_flags.json": (json.dumps(flags, indent=2, sort_keys=True) + "\n").encode(),
                 "model.neff": artifact}
        self.store.delete(f"{entry}/model.log")
        for name, data in files.items():
            self.store.write(f"{entry}/{name}", data)
        done = {"files": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in files.items()},
                "compile_seconds": round(seconds, 3), "created": time.time()}
        self.store.write(f"{entry}/model.done", json.dumps(done, indent=2, sort_keys=True).encode())

    def record_failure(self, entry: str, graph_text: str, flags: dict, log: str) -> None:
        self.store.write(f"{entry}/model.fx.txt", graph_text.encode())
        self.store.write(f"{entry}/compile_flags.json", json.dumps(flags, sort_keys=True).encode())
        self.store.write(f"{entry}/model.log", log.encode())

    def discard(self, entry: str) -> None:
        """Forget a corrupt or failed entry's result so it is compiled again (`model.done` first,
        so a reader never takes a half-removed entry for a done one)."""
        for name in ("model.done", "model.neff", "model.log"):
            self.store.delete(f"{entry}/{name}")

    def _usage(self, entry: str) -> tuple[int, float | None]:
        """The entry's hit count and last use; a garbled usage.json counts as none (the next hit rewrites it)."""
        usage = self._json(f"{entry}/usage.json") or {}
        hits, last = usage.get("hits"), usage.get("last_used")
        return hits if type(hits) is int else 0, last if type(last) in (int, float) else None

    def record_hit(self, entry: str) -> None:
        record = {"hits": self._usage(entry)[0] + 1, "last_used": time.time()}
        self.store.write(f"{entry}/usage.json", json.dumps(record).encode())

    # -- maintenance -----------------------------------------------------------------------------

    def entries(self, deep: bool = False) -> list[EntryInfo]:
        """Every entry, from one listing and each entry's small metadata files (`deep`: checksums too).
        Raises FatalError when the URL is not a cache root: a missing local folder, or one compiler
        version's folder (its entries sit at the top, not one level down)."""
        root = getattr(self.store, "root", None)  # an S3 prefix is never missing, only empty
        if root is not None and not root.is_dir():
            raise FatalError(f"{self.where()}: no such folder; check compile.cache_url")
        grouped: dict[str, list] = {}
        version_folder = False
        for obj in self.store.list():
            parts = obj.name.split("/")
            if len(parts) == 3 and parts[1].startswith("MODULE_"):
                grouped.setdefault(f"{parts[0]}/{parts[1]}", []).append(obj)
            version_folder = version_folder or (len(parts) == 2 and parts[0].startswith("MODULE_"))
        if version_folder and not grouped:
            raise FatalError(f"{self.where()}: holds compile cache entries directly, so it is one compiler "
                             "version's folder; pass its parent, the cache root (the folder compile.cache_url "
                             "names, which holds one folder per compiler version)")
        out = []
        for entry, objects in sorted(grouped.items()):
            hits, last_used = self._usage(entry)
            compiler, key = entry.split("/")
            out.append(EntryInfo(compiler, key, self.state(entry, deep, objects), sum(o.size for o in objects),
                                 hits, last_used, min(o.modified for o in objects)))
        return out

    def prune(self, current_compiler: str, *, failed: bool = False, older_than_days: float | None = None,
              other_versions: bool = False, dry_run: bool = False) -> list[EntryInfo]:
        """Remove what is asked for; never an entry being compiled (locked)."""
        now, removed = time.time(), []
        for info in self.entries(deep=failed):  # a corrupt entry is found only by reading it
            if info.state == LOCKED:
                continue
            last = info.last_used or info.created
            if ((failed and info.state in (FAILED, CORRUPT))
                    or (older_than_days is not None and now - last > older_than_days * 86400)
                    or (other_versions and info.compiler != current_compiler)):
                removed.append(info)
                if not dry_run:
                    self.store.delete_prefix(f"{info.compiler}/{info.key}/")
        return removed
