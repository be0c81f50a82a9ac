"""Versioned outputs: each model version writes its own folder, and `_current.json`, written in one
atomic step after the folder is complete, says which is published."""

import hashlib
import json

import pytest

from trnflow.workload.embeddings import (
    CURRENT,
    MANIFEST,
    current,
    current_url,
    marker_name,
    point_current,
    shard_name,
    version_url,
)


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


def test_each_version_keeps_its_outputs_and_the_pointer_moves_back_and_forth(tmp_path):
    """Item 2: a new version does not overwrite the outputs of the one before, and pointing back at
    the old one (a rollback) republishes it unchanged."""
    out = str(tmp_path)
    assert version_url(out, 3).endswith("/v000003")
    first = _output(tmp_path / "v000001", "plan-1", 2, b"v1")
    second = _output(tmp_path / "v000002", "plan-2", 3, b"v2")
    assert current(out) is None and current_url(out) == out  # nothing published yet
    point_current(out, "m", 1)
    point_current(out, "m", 2)
    assert current(out)["version"] == 2 and current(out)["rows"] == 24
    assert current_url(out).endswith("/v000002")
    point_current(out, "m", 1)  # a rollback
    pointer = json.loads((tmp_path / CURRENT).read_text())
    assert pointer["version"] == 1 and pointer["folder"] == "v000001" and pointer["checkpoint"] == first["checkpoint"]
    assert json.loads((tmp_path / "v000002" / MANIFEST).read_text()) == second  # untouched


def test_the_pointer_never_names_an_incomplete_folder(tmp_path):
    out = str(tmp_path)
    _output(tmp_path / "v000001", "plan-1", 2, b"v1")
    point_current(out, "m", 1)
    _output(tmp_path / "v000002", "plan-2", 2, b"v2")
    (tmp_path / "v000002" / MANIFEST).unlink()  # its inference was cut short
    with pytest.raises(FileNotFoundError, match=r"v000002 has no complete output"):
        point_current(out, "m", 2)
    with pytest.raises(FileNotFoundError):
        point_current(out, "m", 7)  # never ran
    assert current(out)["version"] == 1


def test_the_newest_complete_folder_of_a_version_is_the_one_published(tmp_path):
    import os

    from trnflow.workload.embeddings import latest_folder

    out = str(tmp_path)
    _output(tmp_path / "v000003", "plan-1", 1, b"v3")
    _output(tmp_path / "v000003-rerun", "plan-2", 1, b"v3")
    _output(tmp_path / "v000031", "plan-3", 1, b"v31")  # another version, whose name starts the same
    os.utime(tmp_path / "v000003" / MANIFEST, (1, 1))
    assert latest_folder(out, 3) == "v000003-rerun" and latest_folder(out, 31) == "v000031"
    (tmp_path / "v000003-rerun" / MANIFEST).unlink()  # being written
    assert latest_folder(out, 3) == "v000003" and latest_folder(out, 4) is None
    assert point_current(out, "m", 3)["folder"] == "v000003"
