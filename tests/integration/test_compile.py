"""Ahead-of-time compilation and the persistent compile cache."""

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import archive
from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.cli.app import app
from trnflow.device.cache import (
    COMPILER_VERSION,
    CORRUPT,
    DONE,
    FAILED,
    LOCKED,
    MISSING,
    CompileCache,
    EntryLocked,
    entry_name,
)
from trnflow.emulator.compiler import compile_flags
from trnflow.measures import ProgramPlan
from trnflow.settings import TrnflowSettings
from trnflow.workload.compile import extract
from trnflow.workload.memory import decided

TINY = {"vocab_size": 256, "d_model": 16, "n_heads": 2, "n_layers": 1, "ffn_dim": 32, "mlp_hidden": [8],
        "seq_len": 8}


@pytest.fixture
def make_spec(make_spec):
    """The session's specs with their layout decided, as a run decides it before any job: the compile
    phase's functions, called here without a backend, take them so."""
    return lambda *args, **sections: decided(make_spec(*args, **sections))


def test_the_same_spec_gives_the_same_keys_on_any_host_and_cache(make_spec, tmp_path):
    spec = make_spec(model={"params": TINY})
    other = make_spec(model={"params": TINY}, compile={"cache_url": str(tmp_path / "other")})
    first, second = extract(spec), extract(other)
    assert [p.key for p in first] == [p.key for p in second]
    assert [p.program for p in first] == ["train_step", "eval_step", "embed_step"]
    assert first[0].graph.data_shapes == "tokens [16, 8] int64"  # the per-core batch of 32 on 2 cores
    other = extract(make_spec(model={"params": TINY}, train={"global_batch_size": 16}))
    assert other[0].key != first[0].key  # a new batch shape is a new graph
    assert other[1].key == first[1].key  # evaluation shapes did not change
    bf16 = extract(make_spec(model={"params": TINY}, compute={"precision": "bf16"}))
    assert {p.key for p in bf16}.isdisjoint(p.key for p in first)  # precision is a compiler flag


def _run(spec, phase="compile", run_id="c", **options):
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    processes = 1 if phase == "compile" else None
    return wait(backend, backend.submit(JobRequest(spec, phase, run_id, processes=processes, options=options)), 0.2)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_check_predicts_compile_and_the_cache_survives_corruption_failure_and_stale_locks(make_spec, tmp_path,
                                                                                          compile_cache):
    # The session's shared cache: this cold compile is the one every later pipeline test hits.
    shared = make_spec()
    predicted = _run(shared, check=True).result.programs
    compiled = _run(shared)
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    assert compiled.result.compiled + compiled.result.hits == 3
    outcome = {r.program: r.status for r in compiled.result.report.values()}
    assert {p.program: p.will == "hit" for p in predicted} == {p: s == "hit" for p, s in outcome.items()}

    # Break a copy of it.
    import shutil

    copy = tmp_path / "cache"
    shutil.copytree(compile_cache, copy)
    spec = make_spec(compile={"cache_url": str(copy), "workers": 2})
    cache = CompileCache(str(copy))
    entries = {p.program: entry_name(p.key) for p in compiled.result.programs}
    cache.discard(entries["embed_step"])
    cache.store.write(f"{entries['embed_step']}/model.log", b"error: compiler crashed\n")
    failed = _run(spec)
    assert failed.state is JobState.FAILED  # a remembered failure is not compiled again...
    assert failed.failure.type == "FatalError" and "--retry-failed" in failed.failure.message
    assert cache.state(entries["embed_step"]) == FAILED

    neff = copy / entries["eval_step"] / "model.neff"
    neff.write_bytes(neff.read_bytes()[:100])  # a truncated artifact
    lock = {"pid": _dead_pid(), "host": socket.gethostname(), "since": 0}
    cache.store.write(f"{entries['embed_step']}/model.lock", json.dumps(lock).encode())
    check = _run(spec, check=True, retry_failed=True).result.programs
    assert [(p.state, p.will) for p in check] == [("done", "hit"), ("corrupt", "compile"), ("failed", "compile")]
    result = CliRunner().invoke(app, ["cache", "verify", str(copy)])
    assert result.exit_code == 1 and "1 corrupt" in result.stdout

    repaired = _run(spec, retry_failed=True)  # ...unless asked; the corrupt one is rebuilt, never loaded
    assert repaired.state is JobState.SUCCEEDED, repaired.failure
    by_program = {r.program: r for r in repaired.result.report.values()}
    assert by_program["train_step"].status == "hit"
    assert by_program["eval_step"].status == "done" and by_program["embed_step"].status == "done"
    assert by_program["embed_step"].stale_lock_cleared is True
    assert {cache.state(e) for e in entries.values()} == {DONE}

    listing = json.loads(CliRunner().invoke(app, ["cache", "ls", str(copy), "--json"]).stdout)
    # the copy holds what earlier tests of this process compiled into the shared cache too
    assert {e["state"] for e in listing} == {"done"}
    assert set(entries.values()) <= {f"{e['compiler']}/{e['key']}" for e in listing}
    assert CliRunner().invoke(app, ["cache", "verify", str(copy)]).exit_code == 0


def test_a_live_lock_is_respected_and_only_its_owner_releases_it(tmp_path):
    mine, theirs = CompileCache(str(tmp_path)), CompileCache(str(tmp_path))
    entry = f"{COMPILER_VERSION}/MODULE_1+2"
    assert mine.acquire_lock(entry) is False
    assert mine.state(entry) == LOCKED
    with pytest.raises(EntryLocked, match="being compiled by pid"):
        theirs.acquire_lock(entry)
    theirs.release_lock(entry)  # not its lock: nothing happens
    assert mine.state(entry) == LOCKED
    mine.release_lock(entry)
    assert mine.state(entry) == MISSING


def test_prune_removes_failed_and_old_entries_but_never_locked_ones(tmp_path):
    root = tmp_path / "cache"
    cache = CompileCache(str(root))
    failed, locked, good, old, garbage = (f"torch-9/MODULE_{i}+0" for i in range(5))
    artifact = archive({"fx/graph.py": b"compiled"})
    cache.record_failure(failed, "g", {}, "boom")
    cache.acquire_lock(locked)
    cache.commit(good, "g", {}, artifact)
    cache.commit(old, "g", {}, artifact)
    cache.commit(garbage, "g", {}, b"checksummed, but no archive")
    cache.commit("torch-1/MODULE_9+0", "g", {}, artifact)
    assert (cache.state(good), cache.state(garbage)) == (DONE, DONE)  # the sizes match: a listing reads no artifact
    assert (cache.state(good, deep=True), cache.state(garbage, deep=True)) == (DONE, CORRUPT)
    assert "matches its checksum but is no archive" in cache.problem(garbage)
    result = CliRunner().invoke(app, ["cache", "prune", str(root), "--failed", "--other-versions",
                                      "--compiler-version", "torch-9"])
    assert result.exit_code == 0, result.output
    assert not (root / failed).exists() and (root / locked).exists() and (root / good / "model.done").exists()
    assert not (root / garbage).exists()
    assert not (root / "torch-1" / "MODULE_9+0").exists()
    assert CliRunner().invoke(app, ["cache", "prune", str(root)]).exit_code == 2  # say what to prune


@pytest.mark.slow
def test_optlevels_trade_compile_time_for_generated_code(make_spec, tmp_path, monkeypatch):
    """O1 keeps the lowered forward and backward graphs; O2 runs Inductor and keeps its built kernels."""
    import io
    import tarfile

    from trnflow.workload.compile import compile_one

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # compile_one uses its own
    names = {}
    for optlevel, program in ((1, "train_step"), (2, "embed_step")):
        spec = make_spec(model={"params": TINY},
                         compile={"optlevel": optlevel, "cache_url": str(tmp_path / f"O{optlevel}")})
        key = next(p.key for p in extract(spec) if p.program == program)
        outcome = compile_one(spec.model_dump_json(), program, key)
        cache = CompileCache(spec.compile.cache_url)
        assert outcome.status == "done", cache.failure_log(entry_name(key))
        with tarfile.open(fileobj=io.BytesIO(cache.load_artifact(entry_name(key)))) as tar:
            names[optlevel] = tar.getnames()
    assert names[1] == ["graph-01.py", "graph-02.py"]  # forward and backward
    assert any(name.endswith(".so") for name in names[2])  # built C++ kernels
    assert compile_flags(1, "fp32")["backend"] == "aot_eager"
    assert compile_flags(3, "fp32")["mode"] == "max-autotune-no-cudagraphs"


@pytest.mark.slow
def test_a_kernel_two_programs_share_is_built_once_in_a_compile_job(make_spec, tmp_path, monkeypatch):
    """At O2 a compile job's programs share what Inductor built: a kernel that an earlier program
    built is reused, not built again (the C++ compiler, wrapped here, is asked for each kernel by
    one program only), and each entry's artifact holds exactly the kernels its graphs use, each
    with the source it was built from. Evaluation and inference, compiled one after the other as a
    one-worker pool does, in this process (Inductor's in-memory caches cleared between them, as a
    worker process of its own starts without them)."""
    import io
    import stat
    import tarfile

    from torch._inductor import config
    from torch._inductor.utils import clear_caches

    from trnflow.workload.compile import compile_program

    built = tmp_path / "built.txt"
    cxx = tmp_path / "bin" / "g++"  # the name says which compiler it is
    cxx.parent.mkdir()
    cxx.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in *.cpp) echo "$a" >> {built};; esac; done\n'
                   'exec g++ "$@"\n')
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # compile_program uses its own
    spec = make_spec(model={"params": TINY}, compile={"optlevel": 2, "cache_url": str(tmp_path / "cache")})
    planned = {p.program: p for p in extract(spec)}
    library, cache, kernels = tmp_path / "library", CompileCache(spec.compile.cache_url), {}
    library.mkdir()
    with config.patch({"cpp.cxx": (None, str(cxx))}):
        for program in ("eval_step", "embed_step"):
            clear_caches()
            (outcome,) = compile_program(spec.model_dump_json(), program, [planned[program].key], library=str(library))
            assert outcome.status == "done", cache.failure_log(planned[program].entry)
            with tarfile.open(fileobj=io.BytesIO(cache.load_artifact(planned[program].entry))) as tar:
                names = tar.getnames()
            kernels[program] = {n.rsplit("/", 1)[-1].removesuffix(".so") for n in names if n.endswith(".so")}
            assert kernels[program] == {n.rsplit("/", 1)[-1].removesuffix(".cpp") for n in names
                                        if n.endswith(".cpp")}, program  # each with its source

    where: dict[str, set[Path]] = {}  # each kernel's source -> the work folders it was built in
    for source in map(Path, built.read_text().split()):
        where.setdefault(source.name, set()).add(source.parents[1])
    assert set(where) == {f"{k}.cpp" for k in kernels["eval_step"] | kernels["embed_step"]}
    assert all(len(folders) == 1 for folders in where.values()), where  # by one program each
    assert kernels["eval_step"] & kernels["embed_step"]  # built once, held by both artifacts
    assert not kernels["eval_step"] <= kernels["embed_step"]  # compiled second, it holds only its own


def test_one_run_of_a_program_files_its_graphs_and_one_it_did_not_trace_fails_alone(make_spec, tmp_path,
                                                                                       monkeypatch):
    """A worker compiles a program's missing graphs with one run of it: each graph the run traced is
    filed; a key it did not trace (a program that is not deterministic) fails alone, with the reason
    in its log."""
    from trnflow.workload.compile import compile_program

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # compile_program uses its own
    spec = make_spec(model={"params": TINY}, compile={"optlevel": 1, "cache_url": str(tmp_path / "cache")})
    key = next(p.key for p in extract(spec) if p.program == "eval_step")
    ghost = "MODULE_1+" + key.split("+")[1]  # the same flags, a graph the program never traces
    done, failed = compile_program(spec.model_dump_json(), "eval_step", [key, ghost])
    cache = CompileCache(spec.compile.cache_url)
    assert (done.status, done.together, cache.state(entry_name(key))) == ("done", 1, DONE), done
    assert (failed.status, cache.state(entry_name(ghost))) == ("failed", FAILED), failed
    assert "not deterministic" in cache.failure_log(entry_name(ghost))
    assert not cache.failure_log(entry_name(key))


def test_a_compile_files_its_graph_in_the_neuron_cache_layout(make_spec, tmp_path, monkeypatch):
    """`neuronxcc-<compiler version>/MODULE_<graph hash>+<8-hex flags hash>/`, holding the artifact,
    the flags and an empty done marker, as a real Neuron cache entry does; trnflow's checksums
    have a file of their own."""
    import io
    import re
    import tarfile

    from trnflow.workload.compile import compile_one

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))  # compile_one uses its own
    spec = make_spec(model={"params": TINY}, compile={"optlevel": 1, "cache_url": str(tmp_path / "cache")})
    key = next(p.key for p in extract(spec) if p.program == "eval_step")
    assert compile_one(spec.model_dump_json(), "eval_step", key).status == "done"

    (version,) = (tmp_path / "cache").iterdir()
    assert version.name == COMPILER_VERSION and re.fullmatch(r"neuronxcc-torch-[0-9].*", version.name)
    (entry,) = version.iterdir()
    assert entry.name == key and re.fullmatch(r"MODULE_[0-9a-f]+\+[0-9a-f]{8}", key)
    assert {p.name for p in entry.iterdir()} == {"model.fx.txt", "compile_flags.json", "model.neff",
                                                 "trnflow.json", "model.done"}
    assert (entry / "model.done").read_bytes() == b""
    assert "--optlevel=1" in json.loads((entry / "compile_flags.json").read_text())  # a list, as neuronx-cc writes it
    with tarfile.open(fileobj=io.BytesIO((entry / "model.neff").read_bytes())) as tar:
        assert tar.getnames() == ["graph-01.py"]  # the lowered forward graph (evaluation has no backward)
    assert CompileCache(str(tmp_path / "cache")).state(entry_name(key), deep=True) == DONE


def test_listing_and_warm_checks_read_only_metadata_never_an_artifact(tmp_path):
    from trnflow.device import plans
    from trnflow.storage import LocalStore

    class Reads(LocalStore):
        def __init__(self, root):
            super().__init__(root)
            self.names: list[str] = []

        def read(self, name):
            self.names.append(name)
            return super().read(name)

    store = Reads(tmp_path / "cache")
    cache = CompileCache(str(tmp_path / "cache"), store=store)
    key = "MODULE_abc+def"
    cache.commit(entry_name(key), "graph", {"optlevel": 2}, archive({"kernel.py": b"x" * 1000}))
    store.names.clear()
    assert [e.state for e in cache.entries()] == [DONE]
    assert plans.predict([ProgramPlan(program="train_step", key=key)], cache, retry_failed=False)[0].will == "hit"
    assert not any(n.endswith(("model.neff", "model.fx.txt")) for n in store.names), store.names
    assert [e.state for e in cache.entries(deep=True)] == [DONE]  # `cache verify` reads them, on purpose
    assert any(n.endswith("model.neff") for n in store.names)


def test_the_trial_the_parallel_compiler_wraps_writes_a_result_of_its_own_kind(make_spec, tmp_path):
    """`compile --options '{"trial": true}'`, the program the SDK's neuron_parallel_compile runs: every
    program run for its trial steps, and a result.json that reads as a TrialResult (not a compile
    stage's result, which the job would refuse to write)."""
    from trnflow.results import TrialResult
    from trnflow.workload.programs import TRIAL_STEPS, programs_of

    spec = make_spec(cores=1)
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    (tmp_path / "options.json").write_text(json.dumps({"trial": True}))
    done = subprocess.run([sys.executable, "-m", "trnflow.workload", "compile", "--spec", str(tmp_path / "spec.json"),
                           "--options", str(tmp_path / "options.json"), "--output", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = TrialResult.model_validate_json((tmp_path / "out" / "result.json").read_text())
    assert result.trial and result.programs == list(programs_of(spec)) and result.steps == TRIAL_STEPS
