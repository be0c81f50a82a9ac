"""The layout of an inference output, and publishing one that was staged.

Under `inference.output_url` (a folder or an S3 prefix):

    part-00007.parquet               id, embedding, model_version
    _committed/part-00007.json       written after it: rows, sha256 and size of the file, the plan
    _manifest.json                   written last: every shard with its row count and checksum
    _staging/<run id>/...            the same layout, for a candidate model not yet champion

The bookkeeping names start with `_`, so Parquet readers that are handed the folder (pyarrow,
pandas, Spark) see only the published shards. Retraining embeds with its candidate into its run's
staging folder, and only a promoted candidate's embeddings are published: copied shard by shard
(a shard already there with the same plan is kept), the manifest last. A publication cut short
is finished by publishing again, since the staged copy stays until the manifest is written.
"""

from __future__ import annotations

import hashlib
import json
import re

from trnflow.storage import Store, join, open_store

MANIFEST = "_manifest.json"
STAGING = "_staging"
_OURS = re.compile(r"(?:_committed/)?part-(\d{5})\.(?:parquet|json)")


def shard_name(shard: int) -> str:
    return f"part-{shard:05d}"


def marker_name(shard: int) -> str:
    return f"_committed/{shard_name(shard)}.json"


def staging_url(output_url: str, run_id: str) -> str:
    """Where a retraining run embeds with its candidate before the candidate is champion."""
    return join(output_url, STAGING, run_id)


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


def publish(staged_url: str, output_url: str, checkpoint: str) -> dict | None:
    """Make the complete staged output at `staged_url`, embedded by `checkpoint`, the published one
    at `output_url`, and clear the staging area. Returns the published manifest, or None when
    nothing complete from that checkpoint is staged there (an inference cut short, a publication
    that already finished, or another run's candidate staged under a reused run id)."""
    staged, out = open_store(staged_url), open_store(output_url)
    document = manifest(staged_url)
    if document is None or document.get("checkpoint") != checkpoint:
        return None
    out.delete(MANIFEST)  # the output is incomplete until the manifest is back
    for shard in (s["shard"] for s in document["shards"]):
        if committed(out, shard, document["plan"]) is None:
            out.write(f"{shard_name(shard)}.parquet", staged.read(f"{shard_name(shard)}.parquet"))
            out.write(marker_name(shard), staged.read(marker_name(shard)))  # the commit, last
    remove_beyond(out, len(document["shards"]))
    out.write(MANIFEST, json.dumps(document, indent=1).encode())
    out.delete_prefix(f"{STAGING}/")  # this run's copy, and those of runs that failed before promoting
    return document
