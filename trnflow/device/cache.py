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

A listing of every entry (`entries`, behind `trnflow cache ls`) reads one listing of the cache and,
per version folder that holds trnflow's entries, one index, `<version folder>/trnflow-index.json`:
what the last listing read from each entry's trnflow.json and usage.json, each with the size and
time of the files it came from. The listing stays the truth: an entry the index does not know, or
whose files are not listed as the index saw them, is read again, and an entry the index knows but
the listing lacks is not listed. Only listings write the index (and a prune drops what it removed
from it); compiles and hits never touch it, so concurrent writers on any number of hosts, on S3
without appends or renames, cannot make it wrong, only out of date, which costs a read again.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
import socket
import stat
import tarfile
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from trnflow.device.signing import PUBLIC_KEY_ENV, EntryKeys
from trnflow.errors import FatalError
from trnflow.processes import pid_alive
from trnflow.storage import ObjectInfo, Store, join, open_store

_TORCH = metadata.version("torch")
COMPILER_VERSION = f"neuronxcc-torch-{_TORCH}"
"""The folder entries are filed under, named as neuronx-cc names its own (`neuronxcc-<version>`).
The torch version stands for the compiler's, marked `torch-` so that no tool takes it for a
release of neuronx-cc (whose folders sit beside it in a cache the `xla` device shares)."""
LEGACY_VERSION = f"torch-{_TORCH}"
"""Where trnflow's old layout filed this torch's entries (their checksums in model.done)."""
DONE, FAILED, CORRUPT, LOCKED, MISSING = "done", "failed", "corrupt", "locked", "missing"
TRNFLOW, NEURONXCC = "trnflow", "neuronx-cc"
"""Who wrote an entry (`EntryInfo.origin`)."""
CHECKED_FILES = ("model.fx.txt", "compile_flags.json", "model.neff")
DONE_MARKER = "model.done"
RECORD = "trnflow.json"
"""trnflow's record of a done entry: each file's checksum. model.done stays the empty marker
neuronx-cc writes, so the record has a file of its own."""
SIGNATURE = "trnflow.sig"
"""The compile stage's signature of the entry's trnflow.json (base64), where entries are signed."""
USAGE = "usage.json"
"""An entry's hit count and last use."""
_RECORDED_NAMES = (frozenset(CHECKED_FILES), frozenset((*CHECKED_FILES, DONE_MARKER)))
"""The files a checksum record can cover (`_checked`): the old layout's, and trnflow.json's."""
_OWN_FILES = frozenset({RECORD, SIGNATURE, "model.fx.txt", "model.lock", USAGE})
"""Files only trnflow writes into an entry: an entry holding none of them is neuronx-cc's."""
STALE_LOCK_SECONDS = 24 * 3600.0
"""A lock held this long is taken for abandoned: no compile takes a day, and a pid on this host may
have been given to another process (pid 1 never ends) since the lock was taken."""
LOCK_CLOCK_SKEW_SECONDS = 300.0
"""How far in the future a lock's start time may be (another host's clock running ahead): a lock
taken later than that, or at an infinite time, would never go stale, so it is read as garbled."""
INDEX = "trnflow-index.json"
"""Each version folder's index of what listings read from its entries' small files (see above)."""
INDEXED = (RECORD, DONE_MARKER, USAGE)
"""The files of an entry an index row is read from (model.done holds the old layout's record)."""
INDEX_FORMAT = 2
"""The index's layout: an index in another is read as none (and written again in this one). Format 1
kept each row as a list, [stamp, sizes, hits, last use]; format 2 keeps an `IndexRow`."""
SETTLE_SECONDS = 2.0
"""How much older a file must be than the newest object of a listing before the index keeps what was
read from it. Listed times are coarse (a second on S3, two seconds on some file systems): a rewrite
within that time, at the same size, is listed as the file it replaced. The newest object was written
before the listing began, so a file this much older was rewritten since, if at all, at a later time."""


def _not_an_archive(data: bytes) -> str | None:
    """Why an artifact is not a readable gzipped tar, or None when it is."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.getmembers()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        return str(exc) or type(exc).__name__
    return None


def _short(value: Any, limit: int = 60) -> str:
    """A value read from a file, as a message may quote it: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's digit limit
        return f"a {type(value).__name__} too long to print"
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def entry_name(key: str) -> str:
    """Where a key lives in the cache: `<version folder>/<key>`."""
    return f"{COMPILER_VERSION}/{key}"


def flag_list(flags: dict) -> list[str]:
    """The compiler's settings as compile_flags.json holds them: a list of flags, as neuronx-cc writes
    its own (`["--optlevel=2", "--precision=bf16-sr", ...]`), sorted by name."""
    return [f"--{name}={value if isinstance(value, str) else json.dumps(value, sort_keys=True)}"
            for name, value in sorted(flags.items())]


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
    unsigned = cache.signature_problem(entry) if cache and state == CORRUPT else None
    if unsigned:
        return f"the cache entry is not used: {unsigned}"
    return {CORRUPT: f"the cache entry is corrupt (a file is missing or not as {RECORD} records it)",
            FAILED: "its ahead-of-time compile failed",
            LOCKED: "it is still being compiled"}.get(state, "it is not in the compile cache")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def origin(names: set[str]) -> str:
    """Who wrote an entry holding the files `names`: trnflow, or neuronx-cc (none of trnflow's own)."""
    return TRNFLOW if names & _OWN_FILES else NEURONXCC


def _marked_done(listed: list[ObjectInfo]) -> bool:
    """Whether an entry's listing holds its done marker (whole or not: a corrupt one is compiled
    again, never replaced by an older copy)."""
    return any(o.name.rsplit("/", 1)[-1] == DONE_MARKER for o in listed)


def _checked(record: dict | None) -> dict[str, dict] | None:
    """The files a checksum record covers (the artifact, graph and flags at least, and model.done
    where the record is a file of its own), or None when it is no such record."""
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(isinstance(files.get(n), dict) for n in CHECKED_FILES):
        return None
    covered = (*CHECKED_FILES, DONE_MARKER) if isinstance(files.get(DONE_MARKER), dict) else CHECKED_FILES
    return {name: files[name] for name in covered}


class IndexRow(BaseModel):
    """One entry's row in its version folder's index: how the listing showed the files the row was
    read from, and what they said."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stamp: tuple[tuple[StrictInt, float] | None, ...] = Field(
        description="per file of INDEXED: its listed size and modification time, or null where there is none")
    sizes: dict[str, StrictInt] | None = Field(
        description="the sizes the entry's record gives its checked files (done entries only)")
    hits: StrictInt = Field(ge=0)
    last_used: float | None = Field(description="when it was last loaded (Unix seconds)")

    @model_validator(mode="after")
    def _one_stamp_per_file(self) -> IndexRow:
        if len(self.stamp) != len(INDEXED):
            raise ValueError(f"stamp: {len(self.stamp)} files, where an entry has {len(INDEXED)} ({INDEXED})")
        if self.sizes is not None and self.sizes.keys() not in _RECORDED_NAMES:
            raise ValueError(f"sizes: names {sorted(self.sizes)}, not the files a record covers")
        return self

    @staticmethod
    def stamp_of(listed: dict[str, ObjectInfo]) -> tuple[tuple[int, float] | None, ...]:
        """How a listing shows the files a row is read from (`INDEXED`)."""
        return tuple((listed[name].size, listed[name].modified) if name in listed else None for name in INDEXED)

    def unsettled(self, settled_before: float) -> bool:
        """Whether one of its files was written too recently for the listing to tell a rewrite."""
        return any(seen is not None and seen[1] > settled_before for seen in self.stamp)


def _kept_row(value: Any) -> IndexRow | None:
    """An index's row as `IndexRow`; None for one it cannot be (garbled, or hand-edited): the entry's
    files are then read again, which is what the index saves."""
    try:
        return IndexRow.model_validate(value)
    except ValidationError:
        return None


class _Index:
    """One version folder's index as a listing uses and renews it: `kept`, the rows it was read with;
    `rows`, what this listing read or took over from it, for the next listing."""

    def __init__(self, kept: dict[str, Any], settled_before: float):
        self.kept = {key: row for key, value in kept.items() if (row := _kept_row(value)) is not None}
        self.settled_before = settled_before
        self.rows: dict[str, IndexRow] = {}
        self.unsettled = False
        """Whether a row was left out because its files had not settled (`SETTLE_SECONDS`)."""

    def row(self, key: str, listed: dict[str, ObjectInfo],
            read: Callable[[], tuple[dict[str, int] | None, int, float | None]]) -> IndexRow:
        """An entry's row: as the index kept it while the entry's files are listed as they were then,
        else `read` again (recorded sizes, hits, last use); kept for the next listing once settled."""
        row = self.kept.get(key)
        stamp = IndexRow.stamp_of(listed)
        if row is None or row.stamp != stamp:
            sizes, hits, last_used = read()
            row = IndexRow(stamp=stamp, sizes=sizes, hits=hits, last_used=last_used)
        if row.unsettled(self.settled_before):
            self.unsettled = True
            return row
        self.rows[key] = row
        return row

    def document(self) -> bytes:
        """The index file this listing leaves for the next."""
        entries = {key: row.model_dump(mode="json") for key, row in self.rows.items()}
        return json.dumps({"format": INDEX_FORMAT, "entries": entries}, separators=(",", ":")).encode()


class EntryLocked(Exception):
    def __init__(self, entry: str, owner: dict):
        super().__init__(f"{entry} is being compiled by pid {owner.get('pid')} on {owner.get('host')}")
        self.owner = owner


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
        try:
            value = json.loads(self.store.read(name))
        except (FileNotFoundError, ValueError):  # not JSON, not UTF-8, or a number past Python's digit limit
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
            if not math.isfinite(since) or since > time.time() + LOCK_CLOCK_SKEW_SECONDS:
                raise ValueError("a start time no compile can have")  # it would never go stale
        except (TypeError, ValueError, OverflowError):
            raise FatalError(f"{self.where(f'{entry}/model.lock')}: a garbled lock record (pid "
                             f"{_short(owner.get('pid'))}, since {_short(owner.get('since'))}); trnflow did not "
                             "write it this way and no compile holds it: remove that file") from None
        if not time.time() - since < STALE_LOCK_SECONDS:  # older than any compile: abandoned, whoever holds the pid
            return None
        if owner.get("host") == socket.gethostname():
            return owner if pid_alive(pid) else None
        return owner

    def state(self, entry: str, deep: bool = False, listed: list[ObjectInfo] | None = None) -> str:
        """The entry's state from its metadata: which files it has, and whether their sizes are the
        ones trnflow.json records. `deep` also checks every file's checksum and that the artifact is
        an archive, which reads the artifact (`cache verify` and a compile do; a listing never does).
        `listed` is the entry's objects when the caller has listed them already. An entry not done
        here that trnflow's old layout holds done is copied over first (`adopt`)."""
        if listed is None:
            listed = self.store.list(f"{entry}/")
            if not _marked_done(listed) and self.adopt(entry):
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
                                f"({_short(record.get('entry') if isinstance(record, dict) else None)})")
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
            files = _checked(self._record(entry))
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
        why = _not_an_archive(artifact)  # checksummed as it was written; a load finds out as it unpacks
        return f"{entry}/model.neff matches its checksum but is no archive ({why})" if why else None

    def _verified(self, entry: str) -> dict[str, bytes]:
        """Every checked file of the entry, each read and matched against its checksum."""
        files = _checked(self._record(entry))
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
            if _marked_done(self.store.list(f"{entry}/")) or not self.adopt(entry):
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
        indexes: dict[str, _Index] = {}
        out = []
        for entry, listed in sorted(grouped.items()):
            compiler = entry.split("/")[0]
            if compiler not in indexes:
                kept = self._index(compiler) if compiler in indexed else {}
                indexes[compiler] = _Index(kept, newest - SETTLE_SECONDS)
            out.append(self._listed(entry, listed, deep, indexes[compiler]))
        if not deep:  # a deep listing (`cache verify`) reads every file anyway, and writes nothing
            for compiler in sorted(indexed | set(indexes)):
                self._renew_index(compiler, indexes.get(compiler) or _Index({}, newest), compiler in indexed)
        return out

    def _listed(self, entry: str, listed: dict[str, ObjectInfo], deep: bool, index: _Index) -> EntryInfo:
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

    def _index(self, version: str) -> dict:
        """The rows of a version folder's index; none when it is missing, garbled or of another format."""
        index = self._json(f"{version}/{INDEX}")
        rows = index.get("entries") if index is not None and index.get("format") == INDEX_FORMAT else None
        return rows if isinstance(rows, dict) else {}

    def _renew_index(self, version: str, index: _Index, exists: bool) -> None:
        """Bring a version folder's index up to date with a listing: write it when the listing read what
        it lacked, or left out a row whose files had not settled (written again, the index is newer than
        they are, and the next listing keeps the row); remove it when the folder holds nothing to index.
        A cache this process may only read keeps the index it has."""
        name = f"{version}/{INDEX}"
        try:
            if index.rows or index.unsettled:
                if index.unsettled or not exists or index.rows != index.kept:
                    self.store.write(name, index.document())
            elif exists:
                self.store.delete(name)
        except Exception:  # read-only credentials or file system, say: the next listing reads the entries again
            return

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
                self._forget(version, {info.key for info in removed if info.compiler == version})
        return removed

    def _forget(self, version: str, keys: set[str]) -> None:
        """Drop removed entries' rows from a version folder's index, and the index once it has none."""
        index = _Index(self._index(version), 0.0)
        index.rows = {key: row for key, row in index.kept.items() if key not in keys}
        self._renew_index(version, index, exists=True)
