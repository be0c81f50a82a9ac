"""A registered model's export (`<run>/export/step-NNNNNN/`, written by training in the model's own
library's format, such as `save_pretrained`'s), copied to a local folder for use outside trnflow:
`trnflow models export`, and the way one run's model becomes the next one's pretrained folder.

The export's marker `EXPORTED` lists each file with its sha256 and size. Only listed files are
copied, each checked before it is kept; a name that would leave the folder is refused; the copy is
made in a folder beside the destination and renamed to it once whole.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from trnflow.errors import DataError
from trnflow.fsutil import atomic_write_bytes
from trnflow.lifecycle.cards import CARD, README, CardGate, ExportCard, render
from trnflow.records import EXPORT_MARKER as MARKER
from trnflow.records import ExportedFile, ExportMarker, manifest_digest, read
from trnflow.storage import open_store


def _safe(name: str, origin: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts or name == MARKER:
        raise DataError(f"{origin}: lists {name!r}, which is not a file inside the export; the export is damaged")
    return path


def copy_export(url: str, dest: Path, digest: str | None = None, part: str | None = None,
                gate: CardGate | None = None) -> ExportMarker:
    """Copy the export at `url` into the local folder `dest` (new, or empty), every file checked
    against the marker, and the marker against `digest` (the registry's record of it) when given:
    into a folder beside it first, renamed to `dest` once whole, so that `dest` never holds part of
    an export. `part`: only the export's subfolder of that name (a LoRA adapter's `adapter`), as
    `dest` itself, with a marker of its own files. `gate`: the registry's verdict, written into the
    card (README.md) of an export that has one. The marker written in `dest` is returned.
    DataError names what is missing, damaged or changed, or cannot be written."""
    store = open_store(url)
    marker = read_marker(url)
    if digest is not None and manifest_digest(marker.model_dump(mode="json")["files"]) != digest:
        raise DataError(f"{url}/{MARKER}: lists other files than when the model was registered, so the export was "
                        "changed since and is not copied; export another version (`trnflow models ls`)")
    card = _card(store, url, marker)
    readme = render(card, gate, adapter=part is not None).encode() if card is not None and gate is not None else None
    names = {name: name for name in marker.files}
    if part is not None:
        names = {name: name.removeprefix(f"{part}/") for name in marker.files if name.startswith(f"{part}/")}
        if not names:
            raise DataError(f"{url}: has no {part}/ folder (its recipe wrote none: a LoRA run's export has an "
                            "adapter/ folder); copy the whole export instead")
        marker = ExportMarker(recipe=marker.recipe, files={names[n]: marker.files[n] for n in names},
                              base=marker.base)
    if readme is not None:  # the card as the registry judged the version, in place of training's
        names = {name: new for name, new in names.items() if new != README}
        marker = marker.model_copy(update={"files": {**{n: f for n, f in marker.files.items() if n != README},
                                                     README: _listed(readme)}})
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise DataError(f"{dest}: is not an empty folder; give a new or empty one")
    staging = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        _fill(store, url, marker, names, staging, {README: readme} if readme is not None else {})
        if dest.exists():
            dest.rmdir()  # empty, as checked: the staged folder takes its place
        os.replace(staging, dest)
        staging = None
    except OSError as exc:
        raise DataError(f"{dest}: cannot be written ({exc.strerror or exc}); check the folder and its "
                        "permissions") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return marker


def read_marker(url: str) -> ExportMarker:
    """The `EXPORTED` marker of the export (or pretrained folder) at `url`; DataError when it has none
    or it cannot be read as one."""
    try:
        data = open_store(url).read(MARKER)
    except FileNotFoundError:
        raise DataError(f"{url}: has no {MARKER} marker, so the export was never completed; export the model "
                        "again by training it to its last step") from None
    return read(ExportMarker, data, f"{url}/{MARKER}")


def listing(folder: Path) -> dict[str, dict]:
    """Every file under the local `folder` but a marker, by its name there, with its sha256 and size:
    what an `EXPORTED` marker lists of it (`manifest_digest` of it is the folder's content digest)."""
    listed = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        if name != MARKER:
            with path.open("rb") as f:
                listed[name] = {"sha256": hashlib.file_digest(f, "sha256").hexdigest(), "size": path.stat().st_size}
    return listed


def holds(folder: Path, marker: ExportMarker) -> bool:
    """Whether the local `folder` holds the files `marker` lists, each with its checksum, and nothing
    else but the marker."""
    return folder.is_dir() and listing(folder) == marker.model_dump(mode="json")["files"]


def _listed(data: bytes) -> ExportedFile:
    return ExportedFile(sha256=hashlib.sha256(data).hexdigest(), size=len(data))


def _card(store, url: str, marker: ExportMarker) -> ExportCard | None:
    """The export's card, checked against its marker; None when it has none (exported before cards)."""
    listed = marker.files.get(CARD)
    if listed is None:
        return None
    try:
        data = store.read(CARD)
    except FileNotFoundError:
        raise DataError(f"{url}/{CARD}: listed in {MARKER} but missing; the export is damaged") from None
    if _listed(data) != listed:
        raise DataError(f"{url}/{CARD}: does not match its checksum in {MARKER}; the export is damaged")
    return read(ExportCard, data, f"{url}/{CARD}")


def _fill(store, url: str, marker: ExportMarker, names: dict[str, str], folder: Path,
          written: dict[str, bytes]) -> None:
    """Each file `names` maps (its name in the export to its name in `folder`), checked against
    `marker` (which lists them by their new names), and the files `written` here (listed too), then
    the marker."""
    for new, data in written.items():
        atomic_write_bytes(folder.joinpath(*_safe(new, "the card").parts), data)
    for name, new in sorted(names.items()):
        listed = marker.files[new]
        path = _safe(new, f"{url}/{MARKER}")
        try:
            data = store.read(name)
        except FileNotFoundError:
            raise DataError(f"{url}/{name}: listed in {MARKER} but missing; the export is damaged") from None
        if len(data) != listed.size or hashlib.sha256(data).hexdigest() != listed.sha256:
            raise DataError(f"{url}/{name}: does not match its checksum in {MARKER}; the export is damaged")
        atomic_write_bytes(folder.joinpath(*path.parts), data)
    atomic_write_bytes(folder / MARKER, json.dumps(marker.model_dump(mode="json"), indent=1).encode())
