"""Publishing staged embeddings: the staged set replaces the published one shard by shard, the
manifest last; a publication cut short is finished by publishing again; nothing staged (or staged by
another checkpoint), nothing done."""

import hashlib
import json

import pytest

from trnflow import storage
from trnflow.workload.embeddings import MANIFEST, STAGING, manifest, marker_name, publish, shard_name, staging_url


def _output(root, plan: str, shards: int, tag: bytes) -> dict:
    """An inference output as the infer phase writes it: shards, their markers, the manifest last."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for shard in range(shards):
        data = tag + bytes([shard]) * 8
        (root / f"{shard_name(shard)}.parquet").write_bytes(data)
        (root / "_committed").mkdir(exist_ok=True)
        digest = hashlib.sha256(data).hexdigest()
        (root / marker_name(shard)).write_text(json.dumps({"shard": shard, "rows": 8, "sha256": digest,
                                                            "plan": plan}))
        rows.append({"shard": shard, "file": f"{shard_name(shard)}.parquet", "rows": 8, "sha256": digest})
    document = {"model_version": tag.decode(), "checkpoint": f"file:///ckpt/{tag.decode()}", "plan": plan,
                "rows": 8 * shards, "shards": rows}
    (root / MANIFEST).write_text(json.dumps(document))
    return document


def test_a_staged_set_replaces_the_published_one_and_the_staging_folder_goes(tmp_path):
    out = tmp_path / "embeddings"
    _output(out, "old-plan", 4, b"champion-v1")
    staged = _output(out / STAGING / "run-2", "new-plan", 3, b"candidate-v2")
    _output(out / STAGING / "failed-run", "other-plan", 2, b"rejected")  # a run that never promoted

    v2 = staged["checkpoint"]
    assert publish(staging_url(str(out), "run-2"), str(out), "file:///ckpt/another-candidate") is None
    assert (out / STAGING / "run-2").exists() and manifest(str(out))["checkpoint"] == "file:///ckpt/champion-v1"
    assert publish(staging_url(str(out), "run-2"), str(out), v2) == staged
    assert manifest(str(out)) == staged
    assert [(out / f"{shard_name(s)}.parquet").read_bytes()[:12] for s in range(3)] == [b"candidate-v2"] * 3
    assert not (out / "part-00003.parquet").exists() and not (out / marker_name(3)).exists()
    assert not (out / STAGING).exists()
    assert publish(staging_url(str(out), "run-2"), str(out), v2) is None  # done: nothing staged any more
    assert manifest(str(out)) == staged


def test_a_publication_cut_short_is_finished_by_the_next_one(tmp_path, monkeypatch):
    out = tmp_path / "embeddings"
    _output(out, "old-plan", 3, b"champion-v1")
    staged = _output(out / STAGING / "run-2", "new-plan", 3, b"candidate-v2")
    real_write, writes = storage.LocalStore.write, []

    def write_then_fail(self, name, data):
        writes.append(name)
        if len(writes) == 3:  # shard 0 and its marker went through; shard 1 does not
            raise OSError("connection reset")
        real_write(self, name, data)

    monkeypatch.setattr(storage.LocalStore, "write", write_then_fail)
    with pytest.raises(OSError, match="connection reset"):
        publish(staging_url(str(out), "run-2"), str(out), staged["checkpoint"])
    monkeypatch.setattr(storage.LocalStore, "write", real_write)
    assert manifest(str(out)) is None  # incomplete, and readers of the manifest can tell
    assert (out / STAGING / "run-2" / MANIFEST).exists()

    assert publish(staging_url(str(out), "run-2"), str(out), staged["checkpoint"]) == staged
    assert [(out / f"{shard_name(s)}.parquet").read_bytes()[:12] for s in range(3)] == [b"candidate-v2"] * 3


def test_nothing_complete_staged_leaves_the_published_set_alone(tmp_path):
    out = tmp_path / "embeddings"
    published = _output(out, "plan", 2, b"champion-v1")
    _output(out / STAGING / "cut-short", "plan-2", 2, b"candidate")
    (out / STAGING / "cut-short" / MANIFEST).unlink()  # its inference never finished
    assert publish(staging_url(str(out), "cut-short"), str(out), "file:///ckpt/candidate") is None
    assert publish(staging_url(str(out), "never-ran"), str(out), "file:///ckpt/candidate") is None
    assert manifest(str(out)) == published
