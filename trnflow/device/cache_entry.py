"""What a compile cache entry is made of: the version folders, the entry's files and states, its
key, and the checksums trnflow records (see `trnflow.device.cache` for the layout and its rules)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import zlib
from importlib import metadata
from typing import Any

from trnflow.storage import ObjectInfo, Store

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
RECORDED_NAMES = (frozenset(CHECKED_FILES), frozenset((*CHECKED_FILES, DONE_MARKER)))
"""The files a checksum record can cover (`_checked`): the old layout's, and trnflow.json's."""
OWN_FILES = frozenset({RECORD, SIGNATURE, "model.fx.txt", "model.lock", USAGE})
"""Files only trnflow writes into an entry: an entry holding none of them is neuronx-cc's."""


def not_an_archive(data: bytes) -> str | None:
    """Why an artifact is not a readable gzipped tar, or None when it is."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.getmembers()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        return str(exc) or type(exc).__name__
    return None


def short(value: Any, limit: int = 60) -> str:
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


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def origin(names: set[str]) -> str:
    """Who wrote an entry holding the files `names`: trnflow, or neuronx-cc (none of trnflow's own)."""
    return TRNFLOW if names & OWN_FILES else NEURONXCC


def marked_done(listed: list[ObjectInfo]) -> bool:
    """Whether an entry's listing holds its done marker (whole or not: a corrupt one is compiled
    again, never replaced by an older copy)."""
    return any(o.name.rsplit("/", 1)[-1] == DONE_MARKER for o in listed)


def checked(record: dict | None) -> dict[str, dict] | None:
    """The files a checksum record covers (the artifact, graph and flags at least, and model.done
    where the record is a file of its own), or None when it is no such record."""
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, dict) or not all(isinstance(files.get(n), dict) for n in CHECKED_FILES):
        return None
    covered = (*CHECKED_FILES, DONE_MARKER) if isinstance(files.get(DONE_MARKER), dict) else CHECKED_FILES
    return {name: files[name] for name in covered}


def read_json(store: Store, name: str) -> dict | None:
    """A JSON object the cache holds, or None when it is missing, not JSON or not an object."""
    try:
        value = json.loads(store.read(name))
    except (FileNotFoundError, ValueError):  # not JSON, not UTF-8, or a number past Python's digit limit
        return None
    return value if isinstance(value, dict) else None
