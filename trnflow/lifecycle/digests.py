"""A registered version's files are the ones the gate passed.

A checkpoint's `COMMITTED` and an export's `EXPORTED` sit beside the files they list, where the job
that wrote them can rewrite both. So when a version is registered, the orchestrator reads every
file, checks it against its marker, and records the marker's `manifest_digest` in the registry
entry (`Digests`), which no job can write. Everything that later uses a version checks its files
against that record first: promotion and rollback, `trnflow models export`, inference and the
champion's evaluation (in their jobs), and a run started from the champion (`train.init_from`). A
file changed since stops that use, naming the version and the file.
"""

from __future__ import annotations

import hashlib
import json

from trnflow.errors import DataError, FatalError
from trnflow.lifecycle.registry import Digests, ModelVersion, Registry
from trnflow.records import CHECKPOINT_MARKER, EXPORT_MARKER, manifest_digest
from trnflow.storage import open_store


def verified_manifest(url: str, marker: str) -> str:
    """The `manifest_digest` of the marker at `url`, once every file it lists has been read and
    matches its checksum and size; DataError naming the file that does not."""
    store = open_store(url)
    try:
        listed = json.loads(store.read(marker))["files"]
        if not isinstance(listed, dict) or not all(
                isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in listed.values()):
            raise ValueError("its files are not a mapping of names to checksums")
    except FileNotFoundError:
        raise DataError(f"{url}: has no {marker} marker") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{url}/{marker}: not a marker trnflow wrote ({exc})") from None
    for name, expected in sorted(listed.items()):
        try:
            data = store.read(name)
        except FileNotFoundError:
            raise DataError(f"{url}/{name}: listed in {marker} but missing") from None
        if hashlib.sha256(data).hexdigest() != expected["sha256"] or len(data) != expected.get("size", len(data)):
            raise DataError(f"{url}/{name}: does not match its checksum in {marker}")
    return manifest_digest(listed)


def registered_digests(checkpoint: str, export: str | None) -> Digests:
    """The digests to register a version with, from its files as they are now (DataError when one
    does not match its marker: such a model is not registered)."""
    return Digests(checkpoint=verified_manifest(checkpoint, CHECKPOINT_MARKER),
                   export=verified_manifest(export, EXPORT_MARKER) if export else None)


def _unchanged(who: str, url: str, marker: str, recorded: str) -> None:
    try:
        now = verified_manifest(url, marker)
    except DataError as exc:
        raise FatalError(f"{who}: {exc}: its files changed after it was registered, so it is not used. Promote "
                         "or roll back to another version (`trnflow models ls`), or train it again") from None
    if now != recorded:
        raise FatalError(f"{who}: {url}/{marker} lists other files than when it was registered (the registry "
                         f"records {recorded[:12]}, the folder now holds {now[:12]}), so it is not used. Promote or "
                         "roll back to another version (`trnflow models ls`), or train it again")


def check_version(version: ModelVersion, export: bool = True) -> None:
    """FatalError unless `version`'s checkpoint (and, with `export`, its export) are the files it
    was registered with; a version registered without digests (by hand) is refused too."""
    who = f"{version.model} v{version.version}"
    digests = version.entry.digests
    if digests is None:
        raise FatalError(f"{who}: registered without digests of its files (by hand, or by an older trnflow), so "
                         "nothing shows its checkpoint is the one that was registered; register it again from a "
                         "run (`trnflow run`), or promote another version")
    _unchanged(who, version.checkpoint, CHECKPOINT_MARKER, digests.checkpoint)
    if export and version.entry.export:
        if digests.export is None:
            raise FatalError(f"{who}: its export {version.entry.export} was registered without a digest, so it is "
                             "not used; register the model again from a run")
        _unchanged(who, version.entry.export, EXPORT_MARKER, digests.export)


def registered_as(registry_url: str | None, model: str, checkpoint: str) -> ModelVersion | None:
    """The registered version whose checkpoint is `checkpoint` (newest first), or None: what a job
    given a checkpoint checks it against before loading it."""
    if not registry_url:
        return None
    registry = Registry(registry_url)
    wanted = checkpoint.rstrip("/")
    for number in reversed(registry.numbers(model)):
        version = registry.version(model, number)
        if version.checkpoint.rstrip("/") == wanted:
            return version
    return None
