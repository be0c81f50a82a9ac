"""Ahead-of-time compilation and the persistent compile cache."""

import json
import shutil
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.cli import app
from trnflow.emulator import cache
from trnflow.settings import TrnflowSettings
from trnflow.workload.compile import extract

TINY = {"vocab_size": 256, "d_model": 16, "n_heads": 2, "n_layers": 1, "ffn_dim": 32, "mlp_hidden": [8],
        "seq_len": 8}


def test_the_same_spec_gives_the_same_keys_in_any_cache(make_spec, tmp_path):
    spec = make_spec(model=TINY)
    first = extract(spec, tmp_path / "a")
    second = extract(spec, tmp_path / "b")
    assert [p.key for p in first] == [p.key for p in second]
    assert [p.program for p in first] == ["train_step", "eval_step", "embed_step"]
    assert first[0].entry.parent.parent == tmp_path / "a"
    other = extract(make_spec(model=TINY, train={"global_batch_size": 16}), tmp_path / "a")
    assert other[0].key != first[0].key  # a new batch shape is a new graph
    assert other[1].key == first[1].key  # evaluation shapes did not change
    bf16 = extract(make_spec(model=TINY, compute={"precision": "bf16"}), tmp_path / "a")
    assert {p.key for p in bf16}.isdisjoint(p.key for p in first)  # precision is a compiler flag


def _compile(spec, **options):
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    return wait(backend, backend.submit(JobRequest(spec, "compile", "c", processes=1, options=options)), 0.2)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_check_predicts_compile_and_the_cache_survives_corruption_failure_and_stale_locks(make_spec, tmp_path,
                                                                                          compile_cache):
    # The session's shared cache: this cold compile is the one every later pipeline test hits.
    shared = make_spec()
    predicted = _compile(shared, check=True).result["programs"]
    compiled = _compile(shared)
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    assert compiled.result["compiled"] + compiled.result["hits"] == 3
    assert [p["will"] == "hit" for p in predicted] == [r["status"] == "hit" for r in (
        next(r for r in compiled.result["report"].values() if r["program"] == p["program"]) for p in predicted)]
    assert [p["will"] for p in _compile(shared, check=True).result["programs"]] == ["hit"] * 3

    # Break a copy of it.
    copy = tmp_path / "cache"
    shutil.copytree(compile_cache, copy)
    spec = make_spec(compile={"cache_url": str(copy), "workers": 2})
    entries = {p["program"]: copy / compiled.result["compiler"] / p["key"] for p in compiled.result["programs"]}
    cache.discard(entries["embed_step"])
    (entries["embed_step"] / "model.log").write_text("error: compiler crashed\n")
    failed = _compile(spec)
    assert failed.state is JobState.FAILED  # a remembered failure is not compiled again...
    assert failed.failure["type"] == "FatalError" and "--retry-failed" in failed.failure["message"]
    assert cache.state(entries["embed_step"]) == cache.FAILED

    neff = entries["eval_step"] / "model.neff"
    neff.write_bytes(neff.read_bytes()[:100])  # a truncated artifact
    (entries["embed_step"] / "model.lock").write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    check = _compile(spec, check=True, retry_failed=True).result["programs"]
    assert [(p["state"], p["will"]) for p in check] == [("done", "hit"), ("corrupt", "compile"), ("failed", "compile")]
    result = CliRunner().invoke(app, ["cache", "verify", str(copy)])
    assert result.exit_code == 1 and "1 corrupt" in result.stdout

    repaired = _compile(spec, retry_failed=True)  # ...unless asked; the corrupt one is rebuilt, never loaded
    assert repaired.state is JobState.SUCCEEDED, repaired.failure
    by_program = {r["program"]: r for r in repaired.result["report"].values()}
    assert by_program["train_step"]["status"] == "hit"
    assert by_program["eval_step"]["status"] == "done" and by_program["embed_step"]["status"] == "done"
    assert by_program["embed_step"]["stale_lock_cleared"] is True
    assert {cache.state(e) for e in entries.values()} == {cache.DONE}

    listing = json.loads(CliRunner().invoke(app, ["cache", "ls", str(copy), "--json"]).stdout)
    assert {e["state"] for e in listing} == {"done"} and len(listing) == 3
    assert CliRunner().invoke(app, ["cache", "verify", str(copy)]).exit_code == 0


def test_a_live_lock_is_respected(tmp_path):
    entry = tmp_path / "torch-x" / "MODULE_1+2"
    cache.acquire_lock(entry)
    assert cache.state(entry) == cache.LOCKED
    with pytest.raises(cache.EntryLocked, match="being compiled by pid"):
        cache.acquire_lock(entry)
    cache.release_lock(entry)
    assert cache.state(entry) == cache.MISSING


def test_prune_removes_failed_and_old_entries_but_never_locked_ones(tmp_path):
    root = tmp_path / "cache"
    failed, locked, good, old = (root / "torch-9" / f"MODULE_{i}+0" for i in range(4))
    cache.record_failure(failed, "g", {}, "boom")
    cache.acquire_lock(locked)
    cache.commit(good, "g", {}, b"artifact")
    cache.commit(old, "g", {}, b"artifact")
    (root / "torch-1" / "MODULE_9+0").mkdir(parents=True)
    result = CliRunner().invoke(app, ["cache", "prune", str(root), "--failed", "--other-versions",
                                      "--compiler-version", "torch-9"])
    assert result.exit_code == 0, result.output
    assert not failed.exists() and locked.exists() and good.exists()
    assert not (root / "torch-1").joinpath("MODULE_9+0").exists()
    assert CliRunner().invoke(app, ["cache", "prune", str(root)]).exit_code == 2  # say what to prune


def test_optlevels_trade_compile_time_for_generated_code(make_spec, tmp_path, monkeypatch):
    """O1 keeps the lowered forward and backward graphs; O2 runs Inductor and keeps its kernels."""
    import tarfile

    from trnflow.emulator.compiler import compile_flags
    from trnflow.workload.compile import compile_one

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # compile_one points it elsewhere
    spec = make_spec(model=TINY)
    names = {}
    for optlevel in (1, 2):
        flags = compile_flags(optlevel, "fp32")
        entry = tmp_path / f"O{optlevel}"
        outcome = compile_one(spec.model_dump_json(), "train_step" if optlevel == 1 else "embed_step", str(entry),
                              flags, "graph")
        assert outcome["status"] == "done", (entry / "model.log").read_text() if (entry / "model.log").exists() else ""
        with tarfile.open(entry / "model.neff") as tar:
            names[optlevel] = tar.getnames()
    assert names[1] == ["graph-01.py", "graph-02.py"]  # forward and backward
    assert any(name.endswith(".so") for name in names[2])  # built C++ kernels
    assert compile_flags(1, "fp32")["backend"] == "aot_eager"
    assert compile_flags(3, "fp32")["mode"] == "max-autotune-no-cudagraphs"
