"""Checkpoints on a local folder and on S3: committed last, torn and corrupted ones passed over,
only the newest kept, and loadable by any PyTorch program."""

import json
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import tiny_m5
from tests.factories import checkpoint_meta
from trnflow.errors import FatalError
from trnflow.storage import LocalStore
from trnflow.workload.checkpoint import MARKER, RunCheckpoints, load, load_model_weights
from trnflow.workload.programs import build_model
from trnflow.workload.recipes.m5_text.tokenizer import train_tokenizer

CFG = tiny_m5()
TOKENIZER = train_tokenizer(["a sturdy kettle", "a flimsy lamp"], 300, 8).to_json().encode()


def _save(run: RunCheckpoints, step: int, keep_latest=None, seed=0):
    model = build_model(CFG, seed=seed)
    rng = [{"torch": torch.get_rng_state(), "sr": torch.Generator().get_state()}]
    url = run.save(step, model.state_dict(), {"state": {}, "param_groups": []}, rng, ("tokenizer.json", TOKENIZER),
                   checkpoint_meta(step=step),
                   keep_latest=keep_latest)
    return url, model


def test_a_torn_checkpoint_is_passed_over_and_cleaned_by_the_next_save(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _save(run, 10)
    _save(run, 20)
    (tmp_path / "r" / "step-000020" / MARKER).unlink()  # the writer died before its marker
    latest = run.latest()
    assert latest is not None and latest.step == 10
    assert latest.watermark == "2026-01-02" and latest.featurizer == TOKENIZER
    _save(run, 30)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["step-000010", "step-000030"]


def test_a_corrupted_checkpoint_fails_its_checksum_and_the_previous_one_is_used(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _, first = _save(run, 10, seed=1)
    _save(run, 20, seed=2)
    weights = tmp_path / "r" / "step-000020" / "model.pt"
    weights.write_bytes(weights.read_bytes()[:-100])
    skipped = []
    latest = run.latest(on_skip=lambda url, why: skipped.append((url, why)))
    assert latest.step == 10
    assert torch.equal(latest.model["head.0.weight"], first.state_dict()["head.0.weight"])
    assert skipped[0][0].endswith("step-000020") and "checksum" in skipped[0][1]


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    for step in (5, 10, 15, 20):
        _save(run, step, keep_latest=2)
    assert run.committed() == [15, 20]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["step-000015", "step-000020"]


def test_checkpoints_on_s3_commit_and_load_the_same_way(s3_bucket):
    run = RunCheckpoints(f"s3://{s3_bucket}/ckpt/run-1")
    url, model = _save(run, 10)
    _save(run, 20, keep_latest=1)
    assert url == f"s3://{s3_bucket}/ckpt/run-1/step-000010"
    assert run.committed() == [20]
    loaded = load(f"s3://{s3_bucket}/ckpt/run-1/step-000020")
    assert loaded.step == 20 and set(loaded.model) == set(model.state_dict())
    with pytest.raises(FatalError, match="no COMMITTED marker"):
        load(url)


@pytest.mark.slow  # a second Python process importing torch: with the integration tests
def test_a_checkpoint_loads_in_a_plain_pytorch_program(tmp_path):
    """A script that imports nothing but torch rebuilds the model from standard layers and loads the
    weights with weights_only=True, strictly."""
    _, model = _save(RunCheckpoints((tmp_path / "r").as_uri()), 5)
    script = textwrap.dedent(f"""
        import sys, torch
        from torch import nn
        assert not any(m.startswith(("trnflow", "trnflow.specs")) for m in sys.modules)
        class Encoder(nn.Module):
            def __init__(self):
                super().__init__()
                self.tokens = nn.Embedding(300, 16, padding_idx=0)
                self.positions = nn.Embedding(8, 16)
                layer = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True, norm_first=True)
                self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
                self.norm = nn.LayerNorm(16)
                self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Dropout(0.0), nn.Linear(8, 2))
        state = torch.load({str(tmp_path / "r" / "step-000005" / "model.pt")!r}, weights_only=True)
        Encoder().load_state_dict(state, strict=True)
        print(sum(v.numel() for v in state.values()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert int(out.stdout) == sum(v.numel() for v in model.state_dict().values())


class Payload:
    def __reduce__(self):
        return (print, ("this ran at load time",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_a_pickled_object_is_refused_by_weights_only(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weight": Payload()}, path)
    with pytest.raises(FatalError, match="pickled Python objects"):
        load(path.as_uri())
    (tmp_path / "raw.pt").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(FatalError, match=r"raw\.pt"):
        load((tmp_path / "raw.pt").as_uri())


def test_a_plain_state_dict_file_is_a_starting_point_with_its_tokenizer(tmp_path):
    model = build_model(CFG, seed=3)
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    plain = load((tmp_path / "weights.pt").as_uri())
    assert plain.step == 0 and plain.featurizer is None and plain.optim is None
    LocalStore(tmp_path).write("tokenizer.json", TOKENIZER)
    assert load((tmp_path / "weights.pt").as_uri(), "tokenizer.json").featurizer == TOKENIZER
    other = build_model(CFG, seed=4)
    load_model_weights(other, plain.model, plain.url)
    assert torch.equal(other.state_dict()["head.0.weight"], model.state_dict()["head.0.weight"])


def test_weights_of_another_shape_are_refused_naming_the_source(tmp_path):
    wide = build_model(tiny_m5(d_model=32), seed=0)
    with pytest.raises(FatalError, match="does not match the spec's model"):
        load_model_weights(build_model(CFG, seed=0), wide.state_dict(), "file:///x/weights.pt")


def test_the_marker_records_every_file_with_its_checksum(tmp_path):
    _save(RunCheckpoints((tmp_path / "r").as_uri()), 7)
    marker = json.loads((tmp_path / "r" / "step-000007" / MARKER).read_text())
    assert set(marker["files"]) == {"model.pt", "optim.pt", "state.pt", "tokenizer.json", "meta.json"}
    assert all(len(f["sha256"]) == 64 for f in marker["files"].values())


def test_after_resuming_past_a_corrupt_checkpoint_the_new_saves_are_never_pruned_away(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _save(run, 60)
    _save(run, 80)
    weights = tmp_path / "r" / "step-000080" / "model.pt"
    weights.write_bytes(b"corrupt")
    assert run.latest(on_skip=lambda *_: None).step == 60  # the run resumes at 60 ...
    _save(run, 70, keep_latest=1)  # ... and its next save outlives both 60 and the corrupt 80
    assert run.committed() == [70]


def test_a_marker_from_an_older_trnflow_is_skipped_with_the_reason(tmp_path):
    run = RunCheckpoints((tmp_path / "r").as_uri())
    _save(run, 10)
    _save(run, 20)
    (tmp_path / "r" / "step-000020" / MARKER).write_text('{"step": 20}')
    reasons = []
    assert run.latest(on_skip=lambda url, why: reasons.append(why)).step == 10
    assert "older trnflow" in reasons[0]
    with pytest.raises(FatalError, match="Use an earlier one or retrain"):
        load((tmp_path / "r" / "step-000020").as_uri())


def test_a_checkpoint_write_that_runs_out_of_disk_leaves_no_step_folder(tmp_path, monkeypatch):
    """The disk fills while optim.pt is written: the error says so, and neither the step folder nor
    a temporary file is left behind, so the run resumes from the last whole checkpoint."""
    import errno

    import trnflow.fsutil
    from trnflow.errors import DiskFull

    run = RunCheckpoints((tmp_path / "r").as_uri())
    _save(run, 10)
    real_fsync = trnflow.fsutil.os.fsync

    def full_on_optimizer(fd):
        if "optim.pt" in __import__("os").readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(trnflow.fsutil.os, "fsync", full_on_optimizer)
    with pytest.raises(DiskFull, match="no space left"):
        _save(run, 20)
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["step-000010"]
    assert run.latest().step == 10
