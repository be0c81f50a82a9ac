"""Sharded checkpoints (DCP) under the commit protocol: every shard's checksum in the marker, a torn
or corrupted one passed over, an index that could run code or name another file refused, and the
shards joined into a plain `model.pt` by hand."""

import io
import json
import pickle
import re

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import tiny_m5
from tests.factories import checkpoint_meta
from trnflow.cli.app import app
from trnflow.errors import FatalError
from trnflow.workload.checkpoint import MARKER, RunCheckpoints, consolidate, load, weights_digest
from trnflow.workload.programs import build_model
from trnflow.workload.sharding import consolidate as join
from trnflow.workload.sharding import save_shards

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process, no group
CFG = tiny_m5()
FEATURIZER = ("tokenizer.json", b"{}")


def _trained(seed: int):
    model = build_model(CFG, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randint(0, 300, (2, 8))).sum().backward()
    optimizer.step()
    return model, optimizer


def _save_sharded(run: RunCheckpoints, step: int, tmp_path, seed: int = 0, commit: bool = True):
    """What a sharded run's ranks do (here one rank, without a process group): clear, store the
    shard files, then rank 0 commits with their checksums."""
    model, optimizer = _trained(seed)
    folder = tmp_path / f"dcp-{step}-{seed}"
    folder.mkdir()
    files = save_shards(model, optimizer, folder)
    run.clear(step)
    listed = run.write_shards(step, files)
    rng = [{"torch": torch.get_rng_state(), "sr": torch.Generator().get_state()}]
    url = run.save(step, None, None, rng, FEATURIZER, checkpoint_meta(step=step), shards=listed) if commit else None
    return url, model, optimizer


def test_a_sharded_checkpoint_lists_every_shard_and_joins_into_the_weights_it_was_given(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, model, optimizer = _save_sharded(run, 10, tmp_path)
    folder = tmp_path / "r" / "step-000010"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["layout"] == "sharded"
    assert {"shards/.metadata", "shards/__0_0.distcp"} <= set(marker["files"])
    assert not (folder / "model.pt").exists() and not (folder / "optim.pt").exists()
    ckpt = load(url)
    assert ckpt.sharded and ckpt.resumable and ckpt.step == 10
    assert weights_digest(ckpt.model) == weights_digest(model.state_dict())
    named = dict(model.named_parameters())
    for name, state in ckpt.optim["state"].items():  # keyed by parameter name
        assert torch.equal(state["exp_avg"], optimizer.state[named[name]]["exp_avg"])


def test_a_torn_sharded_checkpoint_is_passed_over_and_cleaned_by_the_next_save(tmp_path):
    """A rank died after storing its shard, before the marker: the run resumes from the one before,
    and the next save deletes the torn folder."""
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _save_sharded(run, 10, tmp_path)
    _save_sharded(run, 20, tmp_path, commit=False)
    shard = tmp_path / "r" / "step-000020" / "shards" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # and half written
    assert run.latest().step == 10
    _save_sharded(run, 30, tmp_path)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["step-000010", "step-000030"]


def test_a_corrupted_shard_fails_its_checksum_and_the_previous_checkpoint_is_used(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _, first, _ = _save_sharded(run, 10, tmp_path, seed=1)
    _save_sharded(run, 20, tmp_path, seed=2)
    shard = tmp_path / "r" / "step-000020" / "shards" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64])
    skipped = []
    latest = run.latest(on_skip=lambda url, why: skipped.append(why))
    assert latest.step == 10 and weights_digest(latest.model) == weights_digest(first.state_dict())
    assert "shards/__0_0.distcp: does not match its checksum" in skipped[0]


def _reseal(folder, name: str, data: bytes) -> None:
    """Replace a file and its checksum in the marker, as someone able to write the folder could."""
    import hashlib

    (folder / name).write_bytes(data)
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (folder / MARKER).write_text(json.dumps(marker))


class _Payload:
    def __reduce__(self):
        return (exec, ("open('PWNED', 'w').write('ran')",))


def test_a_shard_index_that_would_run_code_is_refused_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, _, _ = _save_sharded(run, 10, tmp_path)
    _reseal(tmp_path / "r" / "step-000010", "shards/.metadata", pickle.dumps(_Payload()))
    with pytest.raises(FatalError, match=r"builtins.exec is not part of a DCP index.*tampered with"):
        load(url)  # its checksums hold, but its index is read only as DCP's records
    reasons = []
    assert run.latest(on_skip=lambda url, why: reasons.append(why)) is None and "DCP index" in reasons[0]
    assert not (tmp_path / "PWNED").exists()


def test_a_shard_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, _, _ = _save_sharded(run, 10, tmp_path)
    index = tmp_path / "r" / "step-000010" / "shards" / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # noqa: S301 (written just now by this test)
    for info in metadata.storage_data.values():
        info.relative_path = "../../../etc/passwd"
    _reseal(tmp_path / "r" / "step-000010", "shards/.metadata", pickle.dumps(metadata))
    with pytest.raises(FatalError, match=re.escape("names '../../../etc/passwd', which is not one of the checkpoint")):
        load(url)


def test_a_shard_index_whose_path_object_pretends_to_be_a_shard_name_is_refused(tmp_path):
    """A path object whose text says `__0_0.distcp` but which joins to another run's shard: paths
    in an index are read as plain text, never as path objects, and nothing sets their state."""
    import pathlib

    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, _, _ = _save_sharded(run, 10, tmp_path)
    elsewhere = RunCheckpoints((tmp_path / "other").as_uri())
    _save_sharded(elsewhere, 10, tmp_path, seed=7)
    theirs = tmp_path / "other" / "step-000010" / "shards" / "__0_0.distcp"

    class Disguised(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, pathlib.PurePath):
                return (pathlib.PosixPath, (str(theirs),), (None, {"_str": "__0_0.distcp"}))
            return NotImplemented

    folder = tmp_path / "r" / "step-000010"
    metadata = pickle.loads((folder / "shards" / ".metadata").read_bytes())  # noqa: S301 (this test's own)
    for info in metadata.storage_data.values():
        info.relative_path = pathlib.PurePosixPath("x")
    buffer = io.BytesIO()
    Disguised(buffer, protocol=2).dump(metadata)
    _reseal(folder, "shards/.metadata", buffer.getvalue())
    with pytest.raises(FatalError, match=r"shards/\.metadata: the shard index is not one DCP wrote"):
        load(url)


def test_a_shard_index_that_would_change_a_class_for_the_whole_process_is_refused(tmp_path):
    import pathlib

    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, _, _ = _save_sharded(run, 10, tmp_path)
    folder = tmp_path / "r" / "step-000010"
    real = (folder / "shards" / ".metadata").read_bytes()
    before = pathlib.PurePosixPath.__reduce__
    # PurePosixPath itself as the target of BUILD, with slot state that would set its __reduce__
    poisoned = (b"\x80\x02cpathlib\nPurePosixPath\nN}X\x0a\x00\x00\x00__reduce__ctorch\nSize\ns\x86b0"
                + real[2:])
    _reseal(folder, "shards/.metadata", poisoned)
    with pytest.raises(FatalError, match="sets state on something that is not one of its records"):
        load(url)
    assert pathlib.PurePosixPath.__reduce__ is before


def test_a_shard_index_naming_a_shard_the_marker_does_not_list_is_passed_over(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _save_sharded(run, 10, tmp_path, seed=1)
    _save_sharded(run, 20, tmp_path, seed=2)
    folder = tmp_path / "r" / "step-000020"
    metadata = pickle.loads((folder / "shards" / ".metadata").read_bytes())  # noqa: S301 (this test's own)
    for info in metadata.storage_data.values():
        info.relative_path = "__5_0.distcp"
    _reseal(folder, "shards/.metadata", pickle.dumps(metadata))
    reasons = []
    assert run.latest(on_skip=lambda url, why: reasons.append(why)).step == 10
    assert "names '__5_0.distcp', which is not one of the checkpoint's shard files" in reasons[0]
    metadata.storage_data = None  # a record of the wrong shape: skipped the same way, never a crash
    _reseal(folder, "shards/.metadata", pickle.dumps(metadata))
    assert run.latest().step == 10


def test_a_shard_index_describing_a_tensor_larger_than_its_files_is_refused(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, _, _ = _save_sharded(run, 10, tmp_path)
    folder = tmp_path / "r" / "step-000010"
    metadata = pickle.loads((folder / "shards" / ".metadata").read_bytes())  # noqa: S301 (this test's own)
    name, item = next((k, v) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size"))
    item.size = torch.Size([1 << 20, 1 << 20])
    _reseal(folder, "shards/.metadata", pickle.dumps(metadata))
    with pytest.raises(FatalError, match=f"makes '{re.escape(name)}' larger than every shard file together"):
        load(url)


def test_a_whole_checkpoint_listing_shard_files_is_refused(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, _, _ = _save_sharded(run, 10, tmp_path)
    folder = tmp_path / "r" / "step-000010"
    marker = json.loads((folder / MARKER).read_text())
    marker["layout"] = "whole"
    (folder / MARKER).write_text(json.dumps(marker))
    with pytest.raises(FatalError, match="which is not a file of the checkpoint's folder"):
        load(url)


def test_consolidate_writes_a_model_pt_that_plain_pytorch_loads_with_equal_outputs(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    url, model, _ = _save_sharded(run, 10, tmp_path)
    model_url, written, _ = consolidate(url)
    assert written and model_url == f"{url}/model.pt"
    assert "model.pt" in json.loads((tmp_path / "r" / "step-000010" / MARKER).read_text())["files"]
    plain = build_model(CFG, seed=99)
    plain.load_state_dict(torch.load(tmp_path / "r" / "step-000010" / "model.pt", weights_only=True))
    tokens = torch.randint(0, 300, (3, 8))
    model.eval(), plain.eval()
    assert torch.equal(plain(tokens), model(tokens))
    ckpt = load(url)  # still sharded, still resumable, its model.pt now read as it is
    assert ckpt.sharded and ckpt.shards and weights_digest(ckpt.model) == weights_digest(join(ckpt.shards)[0])
    assert consolidate(url)[:2] == (model_url, False)


def test_the_checkpoint_consolidate_command(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _, model, _ = _save_sharded(run, 10, tmp_path)
    folder = str(tmp_path / "r" / "step-000010")
    result = CliRunner().invoke(app, ["checkpoint", "consolidate", folder, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert out["written"] and out["sharded"] and out["step"] == 10
    assert out["weights_sha256"] == weights_digest(model.state_dict())
    again = CliRunner().invoke(app, ["checkpoint", "consolidate", folder])
    assert again.exit_code == 0 and "was there already" in again.output
    missing = CliRunner().invoke(app, ["checkpoint", "consolidate", str(tmp_path / "nowhere" / "step-000001")])
    assert missing.exit_code == 2 and "not a committed checkpoint" in missing.output
    assert "Traceback" not in missing.output
