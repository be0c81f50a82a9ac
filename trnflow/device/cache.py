"""The persistent compile cache, in a directory or on S3, in the Neuron persistent cache's folders and
with its markers:

    <cache>/neuronxcc-<compiler version>/MODULE_<graph hash>+<flags hash>/
        model.fx.txt         the canonical graph (what the key was computed from)
        compile_flags.json   the compiler's settings, a JSON list of `--name=value` (`flag_list`)
        model.neff           the compiled artifact
        trnflow.json         the sha256 and size of the files above and of model.done, and the entry's name
        trnflow.sig          the compile stage's Ed25519 signature of trnflow.json, where entries are signed
        model.done           written last, empty, as neuronx-cc writes it
        model.log            instead of model.neff + model.done when compilation failed
        model.lock           while a process compiles the entry (its pid, host and start time)
        usage.json           hit count and last use

The version folders, the `MODULE_<graph hash>+<flags hash>` names, compile_flags.json (a list of
flags, as neuronx-cc writes it), model.neff, model.done and model.log are the Neuron cache's, so one
cache holds the Neuron compiler's entries beside trnflow's and an entry's state (done, failed,
locked) is read the same way from both. What differs, file by file: the graph is an FX graph in
`model.fx.txt`, where neuronx-cc keeps an HLO module in `model.hlo_module.pb`; an emulator entry's
`model.neff` is an archive of the TorchInductor cache, not a NEFF; the lock is `model.lock`, a record
of its holder that trnflow checks (a process gone on this host, or a day's age elsewhere, frees it),
where neuronx-cc's is `model.hlo_module.pb.lock`, named after the HLO module it compiles; trnflow.json
and usage.json are trnflow's own.

So, of Neuron's tools: `--cache_dir` in NEURON_CC_FLAGS and NEURON_COMPILE_CACHE_URL name the cache,
and trnflow finds it from them as the compiler wrapper does. The Neuron compiler (its wrapper,
libneuronxla, neuron_parallel_compile) looks entries up in the folder of its own version by the hash
of an HLO module, so it never loads, recompiles or overwrites one of trnflow's (whose folder is
`neuronxcc-torch-<version>`). What loads a NEFF or reads an HLO module (the Neuron runtime,
neuron-profile) cannot use an emulator entry, and `neuron_parallel_compile --command clear-locks`
is for the compiler's locks, not trnflow's, which trnflow frees itself.

Entries written before compile_flags.json was a list hold the settings as a JSON object. They are
hits as before: the key holds the settings' hash, nothing reads the file back, and the checksum
record covers the file as it was written.

An emulator entry's artifact is code: at optlevel 2 and 3 it holds TorchInductor's cache, whose
records a job unpickles when it loads them. Whoever can write the cache can therefore run code in
every later job, so only the compile stage may write it: a local folder is refused when another user
owns it (or a folder above it) or others can write it (`folder_problem`), and a shared cache takes
only entries the compile stage signed (`trnflow.device.signing`): with TRNFLOW_CACHE_PUBLIC_KEY set,
an entry that is unsigned, signed by another key or copied to another entry's place is never loaded.
It is a miss, reported with why, and the compile stage compiles it again.

A failed entry is remembered: it is not compiled again unless asked (`retry_failed`). A done
entry whose files do not match their checksums is reported as corrupt and compiled again, never
loaded. Entries are named `<version folder>/<key>` in this module's functions.

An entry neuronx-cc wrote (in a cache the `xla` device shares with the Neuron compiler: its
`model.hlo_module.pb`, `model.neff` and `model.done`, with no graph text or record of trnflow's)
is listed with the state the Neuron tools give it: done when it holds `model.neff` and
`model.done`, failed when it holds only `model.log`, locked while a `*.lock` is there. trnflow
cannot check its files, so it never calls one corrupt, and of the Neuron compiler's entries it
prunes only failed ones: their age and version are the Neuron tools' to manage.

trnflow's old layout, `<cache>/torch-<version>/<key>/` with the checksums in model.done, is still
read: those entries are listed as another compiler version's, and a lookup that misses copies this
torch's done entry from there into the new layout (checked first), so an upgrade compiles nothing
again. `trnflow cache prune --other-versions` removes the old folder once no older trnflow uses it.

The index that spares a listing from reading every entry is `trnflow.device.cache_index`; the
entry's lock, `trnflow.device.cache_lock`.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trnflow.device import cache_lock as locks
from trnflow.device.cache_entry import (
    CHECKED_FILES,
    COMPILER_VERSION,
    CORRUPT,
    DONE,
    DONE_MARKER,
    FAILED,
    LEGACY_VERSION,
    LOCKED,
    MISSING,
    NEURONXCC,
    RECORD,
    SIGNATURE,
    TRNFLOW,
    USAGE,
    checked,
    entry_name,
    flag_list,
    marked_done,
    module_key,
    not_an_archive,
    origin,
    read_json,
    sha256,
    short,
)
from trnflow.device.cache_index import INDEX, INDEXED, SETTLE_SECONDS, Index, forget, read_rows, renew
from trnflow.device.cache_lock import EntryLocked
from trnflow.device.signing import PUBLIC_KEY_ENV, EntryKeys
from trnflow.errors import FatalError
from trnflow.storage import ObjectInfo, Store, join, open_store

__all__ = ["COMPILER_VERSION", "CORRUPT", "DONE", "FAILED", "LOCKED", "MISSING", "NEURONXCC", "RECORD", "SIGNATURE",
           "CompileCache", "CorruptEntry", "EntryInfo", "EntryLocked", "UnsignedEntry", "entry_name", "flag_list",
           "folder_problem", "miss_reason", "module_key", "sha256"]


def miss_reason(cache: CompileCache | None, entry: str) -> str:
    """Why a graph's entry could not be used, as a recompilation report says it."""
    try:
        state = cache.state(entry) if cache else MISSING
    except FatalError as exc:  # a garbled lock record: the graph is compiled here all the same
        return str(exc)
    unsigned = cache.signature_problem(entry) if cache and state == CORRUPT else None
    if unsigned:
        return f"the cache entry is not used: {unsigned}"
    return {CORRUPT: f"the cache entry is corrupt (a file is missing or not as {RECORD} records it)",
            FAILED: "its ahead-of-time compile failed",
            LOCKED: "it is still being compiled"}.get(state, "it is not in the compile cache")


def folder_problem(path: Path) -> str | None:
    """Why a local cache folder cannot be trusted, or None: another user owns it, or a folder above it
    (who could move it aside and put another in its place), or others can write it or, without the
    sticky bit that stops them renaming what is not theirs (as in /tmp), a folder above it."""
    me = os.getuid()
    for place in (path, *path.parents):
        try:
            info = place.stat()
        except FileNotFoundError:
            continue  # made by the first write, as this user
        except OSError as exc:
            return f"{place} cannot be checked ({exc.strerror})"
        if info.st_uid not in (me, 0) or (place == path and info.st_uid != me):
            return f"{place} belongs to another user (uid {info.st_uid})"
        if info.st_mode & stat.S_IWOTH and (place == path or not info.st_mode & stat.S_ISVTX):
            return f"{place} can be written by every user (mode {stat.filemode(info.st_mode)})"
    return None


class CorruptEntry(Exception):
    """A done entry whose files do not match their recorded checksums."""


class UnsignedEntry(CorruptEntry):
    """A done entry whose record the compile stage did not sign (or not for this entry), where the
    cache takes only signed entries."""


@dataclass
class EntryInfo:
    compiler: str
    """The version folder: `neuronxcc-torch-<version>` for trnflow's, `neuronxcc-<version>` for the
    Neuron compiler's, `torch-<version>` in trnflow's old layout."""
    key: str
    state: str
    bytes: int
    hits: int
    last_used: float | None
    created: float
    origin: str = TRNFLOW

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class CompileCache:
    """One compile cache, by URL (`file://`, a path, or `s3://bucket/prefix`)."""

    def __init__(self, url: str, store: Store | None = None, keys: EntryKeys | None = None):
        """`keys`: the signing key (the compile stage's) and the key entries are checked with, if any.
        Raises FatalError for a local folder another user owns or others can write (`folder_problem`)."""
        self.store = store or open_store(url)
        self.url = self.store.url
        self.keys = keys or EntryKeys()
        self._token = uuid.uuid4().hex
        root = getattr(self.store, "root", None)
        problem = folder_problem(Path(root)) if root is not None else None
        if problem:
            raise FatalError(f"compile cache {root}: {problem}, so what it holds may not be this user's compiles, and "
                             "loading them runs their code; use a folder of your own (the default, under "
                             "$XDG_CACHE_HOME or ~/.cache), or share a cache on S3 with signed entries")

    def where(self, name: str = "") -> str:
        """Where a cache object is, as a person writes it: a path for a local cache, else its URL."""
        root = getattr(self.store, "root", None)
        if root is not None:
            return str(root / name)
        return join(self.url, name) if name else self.url

    # -- state -----------------------------------------------------------------------------------

    def _json(self, name: str) -> dict | None:
        return read_json(self.store, name)

    def lock_owner(self, entry: str) -> dict | None:
        """The live process compiling this entry, or None (`cache_lock.lock_owner`)."""
        return locks.lock_owner(self.store, entry, self.where)

    def state(self, entry: str, deep: bool = False, listed: list[ObjectInfo] | None = None) -> str:
        """The entry's state from its metadata: which files it has, and whether their sizes are the
        ones trnflow.json records. `deep` also checks every file's checksum and that the artifact is
        an archive, which reads the artifact (`cache verify` and a compile do; a listing never does).
        `listed` is the entry's objects when the caller has listed them already. An entry not done
        here that trnflow's old layout holds done is copied over first (`adopt`)."""
        if listed is None:
            listed = self.store.list(f"{entry}/")
            if not marked_done(listed) and self.adopt(entry):
                listed = self.store.list(f"{entry}/")
        return self._state(entry, {o.name.rsplit("/", 1)[-1]: o.size for o in listed}, deep)

    def signature_problem(self, entry: str) -> str | None:
        """Why a trnflow entry's record is not the compile stage's (where entries are signed), or None."""
        if not self.keys.checks:
            return None
        try:
            self._signed_record(entry)
        except UnsignedEntry as exc:
            return str(exc)
        except CorruptEntry:
            return None  # not whole: a problem of another kind
        return None

    def _signed_record(self, entry: str) -> dict | None:
        """The entry's trnflow.json once its signature verifies, where entries are signed
        (UnsignedEntry if it does not, or it was signed for another entry); None when it has none."""
        try:
            raw = self.store.read(f"{entry}/{RECORD}")
        except FileNotFoundError:
            if self._json(f"{entry}/{DONE_MARKER}"):
                raise UnsignedEntry(f"{entry} is in trnflow's old layout, which is not signed") from None
            return None
        try:
            signature = base64.b64decode(self.store.read(f"{entry}/{SIGNATURE}"), validate=True)
        except FileNotFoundError:
            raise UnsignedEntry(f"{entry} is not signed, and only signed entries are loaded "
                                f"({PUBLIC_KEY_ENV} is set)") from None
        except (binascii.Error, ValueError):
            signature = b""
        if not self.keys.verifies(raw, signature):
            raise UnsignedEntry(f"{entry}/{SIGNATURE} does not verify with {PUBLIC_KEY_ENV}: the entry was not "
                                "written by the compile stage, or was changed since")
        try:
            record = json.loads(raw)
        except ValueError:  # not JSON, not UTF-8 (a signed record always is)
            return None
        if not isinstance(record, dict) or record.get("entry") != entry:
            raise UnsignedEntry(f"{entry}/{RECORD} was signed for another entry "
                                f"({short(record.get('entry') if isinstance(record, dict) else None)})")
        return record

    def _state(self, entry: str, sizes: dict[str, int], deep: bool,
               recorded: Callable[[], dict[str, Any] | None] | None = None) -> str:
        """`state` from the entry's files and their sizes; `recorded` gives the sizes its record holds
        (`_recorded_sizes`, or what the index kept of them)."""
        if DONE_MARKER in sizes:
            return self._done_state(entry, sizes, deep, recorded or (lambda: self._recorded_sizes(entry)))
        if "model.lock" in sizes and self.lock_owner(entry) is not None:
            return LOCKED
        if any(name.endswith(".lock") and name != "model.lock" for name in sizes):
            return LOCKED  # neuronx-cc is compiling it (its lock records no owner to check)
        return FAILED if "model.log" in sizes else MISSING

    def _done_state(self, entry: str, sizes: dict[str, int], deep: bool,
                    recorded: Callable[[], dict[str, Any] | None]) -> str:
        """A done-marked entry's state: trnflow's is checked against its record (every checked file
        listed at the size the record holds; `deep`: its checksums too); the Neuron compiler's is done
        when it holds its artifact, as the Neuron tools judge it."""
        if origin(set(sizes)) == NEURONXCC:
            return DONE if "model.neff" in sizes else FAILED if "model.log" in sizes else MISSING
        if deep:
            return DONE if self.verify(entry) else CORRUPT
        expected = recorded()
        whole = expected is not None and all(sizes.get(name) == size for name, size in expected.items())
        return DONE if whole else CORRUPT

    def _record(self, entry: str) -> dict | None:
        """trnflow's checksum record of an entry: trnflow.json, or model.done in the old layout. Where
        entries are signed, trnflow.json's signature is verified first (UnsignedEntry)."""
        if self.keys.checks:
            return self._signed_record(entry)
        return self._json(f"{entry}/{RECORD}") or self._json(f"{entry}/{DONE_MARKER}")

    def _recorded_sizes(self, entry: str) -> dict[str, Any] | None:
        """The size the entry's record gives each checked file, or None when it has no such record."""
        try:
            files = checked(self._record(entry))
        except UnsignedEntry:
            return None
        return None if files is None else {name: f.get("bytes") for name, f in files.items()}

    def verify(self, entry: str) -> bool:
        """Whether every checked file is present, of its recorded size and checksum."""
        return self.problem(entry) is None

    def problem(self, entry: str) -> str | None:
        """Why a done entry is corrupt, or None when it is whole."""
        try:
            artifact = self._verified(entry)["model.neff"]
        except CorruptEntry as exc:
            return str(exc)
        why = not_an_archive(artifact)  # checksummed as it was written; a load finds out as it unpacks
        return f"{entry}/model.neff matches its checksum but is no archive ({why})" if why else None

    def _verified(self, entry: str) -> dict[str, bytes]:
        """Every checked file of the entry, each read and matched against its checksum."""
        files = checked(self._record(entry))
        if files is None:
            raise CorruptEntry(f"{entry}/{RECORD} is missing, unreadable or not a checksum record")
        out = {}
        for name, expected in files.items():
            try:
                data = self.store.read(f"{entry}/{name}")
            except FileNotFoundError:
                raise CorruptEntry(f"{entry}/{name} is missing") from None
            if len(data) != expected.get("bytes") or sha256(data) != expected.get("sha256"):
                raise CorruptEntry(f"{entry}/{name} does not match its checksum in {RECORD}")
            out[name] = data
        return out

    def load_artifact(self, entry: str) -> bytes:
        """The compiled artifact, checked against its checksum first (CorruptEntry if it fails). An
        entry not done here that trnflow's old layout holds done is copied over first (`adopt`)."""
        try:
            return self._verified(entry)["model.neff"]
        except CorruptEntry:
            if marked_done(self.store.list(f"{entry}/")) or not self.adopt(entry):
                raise
        return self._verified(entry)["model.neff"]

    def adopt(self, entry: str) -> bool:
        """Copy this torch's done entry from trnflow's old layout (`torch-<version>/<key>`, its
        checksums in model.done) to `entry`, checked first, so an upgrade compiles nothing again.
        The old entry stays, for an older trnflow that shares the cache. Two processes that adopt
        one entry at once write the same files. Whether it copied one."""
        version, _, key = entry.partition("/")
        if version != COMPILER_VERSION:
            return False
        old = f"{LEGACY_VERSION}/{key}"
        try:
            files = self._verified(old)
        except CorruptEntry:  # not there, or not whole: compiled again as any miss is
            return False
        record = self._record(old) or {}
        seconds, created = record.get("compile_seconds"), record.get("created")
        self._write_done(entry, {name: files[name] for name in CHECKED_FILES},
                         seconds if isinstance(seconds, int | float) else 0.0,
                         created if isinstance(created, int | float) else time.time())
        return True

    def failure_log(self, entry: str) -> str:
        try:
            return self.store.read(f"{entry}/model.log").decode(errors="replace")
        except FileNotFoundError:
            return ""

    # -- locks -----------------------------------------------------------------------------------

    def acquire_lock(self, entry: str) -> bool:
        """Take the entry's lock (`cache_lock.acquire`): True when a stale one had to be cleared."""
        return locks.acquire(self.store, entry, self._token, self.where)

    def release_lock(self, entry: str) -> None:
        locks.release(self.store, entry, self._token)

    # -- writes ----------------------------------------------------------------------------------

    def commit(self, entry: str, graph_text: str, flags: dict, artifact: bytes, seconds: float = 0.0) -> None:
        """Write a successful entry; `model.done` goes last."""
        files = {"model.fx.txt": graph_text.encode(),
                 "compile_flags.json": json.dumps(flag_list(flags)).encode(),
                 "model.neff": artifact}
        self._write_done(entry, files, seconds, time.time())

    def _write_done(self, entry: str, files: dict[str, bytes], seconds: float, created: float) -> None:
        """The entry's files, then trnflow.json with their checksums and that of model.done, then
        model.done itself, empty as neuronx-cc writes it: a reader that finds the marker finds the rest."""
        self.store.delete(f"{entry}/model.log")
        for name, data in files.items():
            self.store.write(f"{entry}/{name}", data)
        checked = {**files, DONE_MARKER: b""}
        record = {"files": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in checked.items()},
                  "compile_seconds": round(seconds, 3), "created": created, "entry": entry}
        raw = json.dumps(record, indent=2, sort_keys=True).encode()
        signature = base64.b64encode(self.keys.sign(raw)) if self.keys.checks else None  # refused unless signer
        self.store.delete(f"{entry}/{SIGNATURE}")
        self.store.write(f"{entry}/{RECORD}", raw)
        if signature is not None:
            self.store.write(f"{entry}/{SIGNATURE}", signature)
        self.store.write(f"{entry}/{DONE_MARKER}", checked[DONE_MARKER])

    def record_failure(self, entry: str, graph_text: str, flags: dict, log: str) -> None:
        self.store.write(f"{entry}/model.fx.txt", graph_text.encode())
        self.store.write(f"{entry}/compile_flags.json", json.dumps(flag_list(flags)).encode())
        self.store.write(f"{entry}/model.log", log.encode())

    def discard(self, entry: str) -> None:
        """Forget a corrupt or failed entry's result so it is compiled again (`model.done` first,
        so a reader never takes a half-removed entry for a done one)."""
        for name in (DONE_MARKER, RECORD, SIGNATURE, "model.neff", "model.log"):
            self.store.delete(f"{entry}/{name}")

    def _usage(self, entry: str) -> tuple[int, float | None]:
        """The entry's hit count and last use; a garbled usage.json counts as none (the next hit rewrites it)."""
        usage = self._json(f"{entry}/{USAGE}") or {}
        hits, last = usage.get("hits"), usage.get("last_used")
        return hits if type(hits) is int else 0, last if type(last) in (int, float) else None

    def record_hit(self, entry: str) -> None:
        record = {"hits": self._usage(entry)[0] + 1, "last_used": time.time()}
        self.store.write(f"{entry}/{USAGE}", json.dumps(record).encode())

    # -- maintenance -----------------------------------------------------------------------------

    def entries(self, deep: bool = False) -> list[EntryInfo]:
        """Every entry, trnflow's and neuronx-cc's, from one listing of the cache and each version
        folder's index (an entry's record and usage are read only where the index lacks them or its
        files changed since; `deep`: every checksum is checked, which reads every file). Raises
        FatalError when the URL is not a cache root: a missing local folder, or one compiler version's
        folder (its entries sit at the top, not one level down)."""
        root = getattr(self.store, "root", None)  # an S3 prefix is never missing, only empty
        if root is not None and not root.is_dir():
            raise FatalError(f"{self.where()}: no such folder; check compile.cache_url")
        grouped: dict[str, dict[str, ObjectInfo]] = {}  # entry -> its files by name
        indexed: set[str] = set()
        listing = self.store.list()
        newest = max((obj.modified for obj in listing), default=0.0)
        version_folder = False
        for obj in listing:  # `<version>/<MODULE_key>/<file>` is an entry's file, `<version>/<INDEX>` an index
            folder, _, file = obj.name.rpartition("/")
            _, nested, key = folder.partition("/")
            if nested:
                if key.startswith("MODULE_") and "/" not in key:
                    grouped.setdefault(folder, {})[file] = obj
            elif folder:
                if file == INDEX:
                    indexed.add(folder)
                if folder.startswith("MODULE_"):
                    version_folder = True
        if version_folder and not grouped:
            raise FatalError(f"{self.where()}: holds compile cache entries directly, so it is one compiler "
                             "version's folder; pass its parent, the cache root (the folder compile.cache_url "
                             "names, which holds one folder per compiler version)")
        indexes: dict[str, Index] = {}
        out = []
        for entry, listed in sorted(grouped.items()):
            compiler = entry.split("/")[0]
            if compiler not in indexes:
                kept = read_rows(self.store, compiler) if compiler in indexed else {}
                indexes[compiler] = Index(kept, newest - SETTLE_SECONDS)
            out.append(self._listed(entry, listed, deep, indexes[compiler]))
        if not deep:  # a deep listing (`cache verify`) reads every file anyway, and writes nothing
            for compiler in sorted(indexed | set(indexes)):
                renew(self.store, compiler, indexes.get(compiler) or Index({}, newest), compiler in indexed)
        return out

    def _listed(self, entry: str, listed: dict[str, ObjectInfo], deep: bool, index: Index) -> EntryInfo:
        """One entry of a listing (`listed`: its files by name), its record's sizes and its usage taken
        from `index` where it holds them."""
        compiler, key = entry.split("/")
        names, sizes = set(listed), {name: o.size for name, o in listed.items()}
        writer = origin(names)
        recorded, hits, last_used = None, 0, None
        if writer == TRNFLOW and not names.isdisjoint(INDEXED):
            row = index.row(key, listed, lambda: self._small_files(entry, names))
            recorded, hits, last_used = row.sizes, row.hits, row.last_used
        return EntryInfo(compiler, key, self._state(entry, sizes, deep, lambda: recorded), sum(sizes.values()),
                         hits, last_used, min(o.modified for o in listed.values()), writer)

    def _small_files(self, entry: str, names: set[str]) -> tuple[dict[str, int] | None, int, float | None]:
        """What an index row holds, read from the entry's files (`names`, as listed): the sizes its record
        gives the checked files (done entries only), its hits and its last use."""
        recorded = self._recorded_sizes(entry) if DONE_MARKER in names else None
        hits, last_used = self._usage(entry) if USAGE in names else (0, None)
        return recorded, hits, last_used

    def prune(self, current_compiler: str, *, failed: bool = False, older_than_days: float | None = None,
              other_versions: bool = False, dry_run: bool = False) -> list[EntryInfo]:
        """Remove what is asked for; never an entry being compiled (locked). Of neuronx-cc's entries
        only failed ones go: trnflow records no use of them, and their version is not trnflow's."""
        now, removed = time.time(), []
        for info in self.entries(deep=failed):  # a corrupt entry is found only by reading it
            if info.state == LOCKED:
                continue
            ours, last = info.origin == TRNFLOW, info.last_used or info.created
            if ((failed and info.state in (FAILED, CORRUPT))
                    or (ours and older_than_days is not None and now - last > older_than_days * 86400)
                    or (ours and other_versions and info.compiler != current_compiler)):
                removed.append(info)
                if not dry_run:
                    self.store.delete_prefix(f"{info.compiler}/{info.key}/")
        if not dry_run:
            for version in sorted({info.compiler for info in removed}):
                forget(self.store, version, {info.key for info in removed if info.compiler == version})
        return removed
