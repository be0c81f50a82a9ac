"""The layout of an inference output, versioned by model, and the pointer to the champion's.

Under `inference.output_url` (a folder or an S3 prefix), for a spec with a model registry:

    v000003/part-00007.parquet       id, embedding (or prediction), model_version
    v000003/_committed/part-00007.json   written after it: rows, sha256 and size of the file, the plan
    v000003/_manifest.json           written last: every shard with its row count and checksum
    v000003-<run id>/...             an on-demand inference of a published version, beside it
    _current.json                    the champion's folder: {"version": 3, "folder": "v000003", ...}

Each registered model version embeds into a folder of its own, so a new model never overwrites
the outputs of the one before, and a rollback only moves the pointer back. Published outputs are
never rewritten in place: inference with the champion on demand writes a new folder and then
moves the pointer. The pointer is one
object written atomically, after the folder it names is complete; readers start from it. A spec
without a registry has no versions: its shards, markers and manifest sit at the top of the output.

The bookkeeping names start with `_`, so Parquet readers that are handed a folder (pyarrow, pandas,
Spark) see only its shards.
"""

from __future__ import annotations

import hashlib
import json
import re
import time

from trnflow.storage import Store, join, open_store

MANIFEST = "_manifest.json"
CURRENT = "_current.json"
_OURS = re.compile(r"(?:_committed/)?part-(\d{5})\.(?:parquet|json)")


def shard_name(shard: int) -> str:
    return f"part-{shard:05d}"


def marker_name(shard: int) -> str:
    return f"_committed/{shard_name(shard)}.json"


def version_folder(version: int) -> str:
    return f"v{version:06d}"


def version_url(output_url: str, version: int) -> str:
    """Where model `version` writes its outputs."""
    return join(output_url, version_folder(version))


def committed(out: Store, shard: int, plan: str) -> dict | None:
    """The shard's marker, if the shard is committed for this plan and its file matches it."""
    try:
        marker = json.loads(out.read(marker_name(shard)))
        if marker.get("plan") != plan:
            return None
        data = out.read(f"{shard_name(shard)}.parquet")
    except (FileNotFoundError, ValueError):
        return None
    if hashlib.sha256(data).hexdigest() != marker.get("sha256"):
        return None
    return marker


def remove_beyond(out: Store, n_shards: int) -> None:
    """Delete the shards (and markers) numbered `n_shards` and up: an earlier, larger output's."""
    for obj in out.list():
        match = _OURS.fullmatch(obj.name)
        if match and int(match.group(1)) >= n_shards:
            out.delete(obj.name)


def manifest(url: str) -> dict | None:
    """The output's manifest: None while it is incomplete (or was never written)."""
    try:
        return json.loads(open_store(url).read(MANIFEST))
    except FileNotFoundError:
        return None


def current(output_url: str) -> dict | None:
    """The pointer to the champion's outputs, or None when nothing was published yet."""
    try:
        return json.loads(open_store(output_url).read(CURRENT))
    except FileNotFoundError:
        return None


def current_url(output_url: str) -> str:
    """Where the champion's outputs are: the folder the pointer names, or (a spec without a registry,
    or before the first publication) the output itself."""
    pointer = current(output_url)
    return join(output_url, pointer["folder"]) if pointer else output_url


def latest_folder(output_url: str, version: int) -> str | None:
    """The newest complete output folder of `version`: its own (`v000003`), or one an on-demand
    inference wrote beside it (`v000003-<run id>`, so as never to rewrite published outputs in
    place); None when it has none."""
    pattern = re.compile(rf"({version_folder(version)}(?:-[A-Za-z0-9._-]+)?)/{re.escape(MANIFEST)}")
    found = [(o.modified, m.group(1)) for o in open_store(output_url).list(version_folder(version))
             if (m := pattern.fullmatch(o.name))]
    return max(found)[1] if found else None


def point_current(output_url: str, model: str, version: int, folder: str | None = None) -> dict:
    """Make version `version`'s complete outputs (in `folder`, by default its newest) the published
    ones by moving the pointer (one atomic write). FileNotFoundError when there is no complete
    output to point at."""
    folder = folder or latest_folder(output_url, version) or version_folder(version)
    document = manifest(join(output_url, folder))
    if document is None:
        raise FileNotFoundError(f"{join(output_url, folder)} has no complete output ({MANIFEST} missing)")
    pointer = {"format": 1, "model": model, "version": version, "folder": folder,
               "rows": document["rows"], "shards": len(document["shards"]), "checkpoint": document["checkpoint"],
               "at": round(time.time(), 3)}
    open_store(output_url).write(CURRENT, json.dumps(pointer, indent=1).encode())
    return pointer
