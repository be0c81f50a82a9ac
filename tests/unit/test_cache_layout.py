"""The compile cache's layout is the Neuron persistent cache's: an entry the Neuron compiler wrote
sits beside trnflow's and is read as the Neuron tools read it, and trnflow's old layout still serves."""

import json
import os
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

from typer.testing import CliRunner

from tests.conftest import archive
from trnflow.cli.app import app
from trnflow.device import plans
from trnflow.device.base import RecompileGuard
from trnflow.device.cache import (
    COMPILER_VERSION,
    CORRUPT,
    DONE,
    LEGACY_VERSION,
    LOCKED,
    NEURONXCC,
    TRNFLOW,
    CompileCache,
    entry_name,
    flag_list,
    sha256,
)
from trnflow.emulator.jit import CachedCompiler

REAL_VERSION = "neuronxcc-2.15.128.0+56dc5a86"
"""A folder as neuronx-cc names it."""


def _real_entry(root: Path, key: str, files: dict[str, bytes]) -> Path:
    """An entry as neuronx-cc leaves it (through neuron_parallel_compile or libneuronxla)."""
    folder = root / REAL_VERSION / key
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def _neuron_cache(root: Path) -> dict[str, Path]:
    """The Neuron compiler's entries in every state it leaves them: done with the empty marker, done
    with a marker of its own content, failed, and being compiled."""
    hlo, neff = b"\x08\x01hlo-module", b"NEFF\x00binary, no archive"
    return {
        "done": _real_entry(root, "MODULE_12486829708343293975+d41d8cd9", {
            "model.hlo_module.pb": hlo, "compile_flags.json": b'["--target=trn1", "--model-type=transformer"]',
            "model.neff": neff, "model.done": b""}),
        "done-marked": _real_entry(root, "MODULE_b42583089ebf9987f31e+2c2d707e", {
            "model.hlo_module.pb": hlo, "model.neff": neff, "model.done": b"PASS\n"}),
        "failed": _real_entry(root, "MODULE_198775565831884870+d41d8cd9", {
            "model.hlo_module.pb": hlo, "model.log": b"ERROR: NCC_EOOM001\n"}),
        "locked": _real_entry(root, "MODULE_9219523464496887986+abb26765", {
            "model.hlo_module.pb": hlo, "model.hlo_module.pb.lock": b""}),
    }


def _ls(root: Path) -> dict[str, dict]:
    result = CliRunner().invoke(app, ["cache", "ls", str(root), "--json"])
    assert result.exit_code == 0, result.output
    return {f"{e['compiler']}/{e['key']}": e for e in json.loads(result.stdout)}


def test_an_entry_is_filed_as_the_neuron_cache_files_it(tmp_path):
    cache = CompileCache(str(tmp_path))
    key = "MODULE_5a5161a0136e695be4d4+e1d943bc"
    artifact = archive({"fx/graph.py": b"compiled"})
    cache.commit(entry_name(key), "graph", {"optlevel": 2}, artifact)
    folder = tmp_path / entry_name(key)
    assert folder.parent.name == COMPILER_VERSION and COMPILER_VERSION.startswith("neuronxcc-")
    assert (folder / "model.neff").read_bytes() == artifact
    # the settings as a list of flags, as neuronx-cc writes its own
    assert json.loads((folder / "compile_flags.json").read_text()) == ["--optlevel=2"]
    assert (folder / "model.done").read_bytes() == b""  # the marker, empty as neuronx-cc writes it
    record = json.loads((folder / "trnflow.json").read_text())["files"]
    assert record["model.neff"] == {"sha256": sha256(artifact), "bytes": len(artifact)}
    assert record["model.done"]["bytes"] == 0
    assert cache.state(entry_name(key), deep=True) == DONE


def test_the_settings_are_written_as_flags_and_the_lock_is_trnflows_own_record(tmp_path):
    """compile_flags.json is a list of `--name=value`, sorted, in every state an entry is written; the
    lock is model.lock (a record of its holder), not the Neuron compiler's model.hlo_module.pb.lock."""
    cache = CompileCache(str(tmp_path))
    flags = {"optlevel": 1, "precision": "bf16-sr", "backend": "aot_eager", "mode": None, "model": "m5-text@1"}
    listed = ["--backend=aot_eager", "--mode=null", "--model=m5-text@1", "--optlevel=1", "--precision=bf16-sr"]
    assert flag_list(flags) == listed
    failed = entry_name("MODULE_1+2")
    cache.record_failure(failed, "graph", flags, "boom")
    assert json.loads((tmp_path / failed / "compile_flags.json").read_text()) == listed
    locked = entry_name("MODULE_3+4")
    cache.acquire_lock(locked)
    assert {p.name for p in (tmp_path / locked).iterdir()} == {"model.lock"}
    assert json.loads((tmp_path / locked / "model.lock").read_text())["pid"] == os.getpid()
    assert cache.state(locked) == LOCKED
    cache.release_lock(locked)
    assert not (tmp_path / locked / "model.lock").exists()


def test_an_entry_written_with_the_settings_as_an_object_is_still_a_hit(tmp_path):
    """Entries written before compile_flags.json was a list hold a JSON object, covered by their
    checksum record as written: they stay done and load, and nothing rewrites them."""
    cache = CompileCache(str(tmp_path))
    entry, artifact = entry_name("MODULE_5+6"), archive({"fx/graph.py": b"compiled"})
    cache.commit(entry, "graph", {"optlevel": 2}, artifact)
    folder = tmp_path / entry
    before = b'{\n  "optlevel": 2\n}\n'  # as they were written
    (folder / "compile_flags.json").write_bytes(before)
    record = json.loads((folder / "trnflow.json").read_text())
    record["files"]["compile_flags.json"] = {"sha256": sha256(before), "bytes": len(before)}
    (folder / "trnflow.json").write_text(json.dumps(record))
    assert cache.state(entry) == DONE and cache.state(entry, deep=True) == DONE
    assert cache.load_artifact(entry) == artifact
    assert (folder / "compile_flags.json").read_bytes() == before


def test_the_neuron_compilers_entries_are_listed_as_its_tools_read_them_and_only_failed_ones_pruned(tmp_path):
    cache = CompileCache(str(tmp_path))
    ours = entry_name("MODULE_5a5161a0136e695be4d4+e1d943bc")
    cache.commit(ours, "graph", {"optlevel": 2}, archive({"fx/graph.py": b"compiled"}))
    real = _neuron_cache(tmp_path)
    name = {state: f"{REAL_VERSION}/{folder.name}" for state, folder in real.items()}

    listed = _ls(tmp_path)
    assert {n: (e["state"], e["origin"]) for n, e in listed.items()} == {
        ours: ("done", TRNFLOW),
        name["done"]: ("done", NEURONXCC), name["done-marked"]: ("done", NEURONXCC),
        name["failed"]: ("failed", NEURONXCC), name["locked"]: ("locked", NEURONXCC)}
    verified = CliRunner().invoke(app, ["cache", "verify", str(tmp_path), "--json"])
    assert verified.exit_code == 0 and json.loads(verified.stdout) == {"checked": 5, "corrupt": []}, verified.output

    pruned = CliRunner().invoke(app, ["cache", "prune", str(tmp_path), "--failed", "--json"])
    assert pruned.exit_code == 0, pruned.output
    assert [f"{e['compiler']}/{e['key']}" for e in json.loads(pruned.stdout)["removed"]] == [name["failed"]]
    assert not real["failed"].exists()  # a remembered failure blocks the Neuron compiler as it does trnflow
    assert {(f / "model.neff").read_bytes() for f in (real["done"], real["done-marked"])} == {
        b"NEFF\x00binary, no archive"}
    assert (real["locked"] / "model.hlo_module.pb.lock").exists()

    # Age and version are the Neuron tools' to judge: trnflow records no use of their entries.
    swept = CliRunner().invoke(app, ["cache", "prune", str(tmp_path), "--other-versions", "--older-than-days", "0"])
    assert swept.exit_code == 0, swept.output
    assert real["done"].exists() and real["done-marked"].exists() and real["locked"].exists()
    assert not (tmp_path / ours).exists()  # unused for more than 0 days


def test_a_done_marker_of_trnflows_own_that_was_overwritten_is_corrupt(tmp_path):
    """The Neuron compiler's marker may hold anything; trnflow's is checksummed empty."""
    cache = CompileCache(str(tmp_path))
    entry = entry_name("MODULE_1+2")
    cache.commit(entry, "graph", {}, archive({"k.py": b"x"}))
    (tmp_path / entry / "model.done").write_text('{"files": {}}')
    assert cache.state(entry) == CORRUPT
    assert "model.done does not match its checksum in trnflow.json" in cache.problem(entry)


def _legacy_entry(root: Path, key: str, artifact: bytes) -> Path:
    """An entry as trnflow filed it before: under `torch-<version>`, the checksums in model.done."""
    folder = root / LEGACY_VERSION / key
    folder.mkdir(parents=True)
    files = {"model.fx.txt": b"graph", "compile_flags.json": b'{"optlevel": 2}\n', "model.neff": artifact}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    record = {"files": {n: {"sha256": sha256(d), "bytes": len(d)} for n, d in files.items()},
              "compile_seconds": 12.5, "created": 1.0}
    (folder / "model.done").write_text(json.dumps(record))
    return folder


def test_trnflows_old_layout_is_listed_and_a_lookup_adopts_its_done_entries(tmp_path):
    key, artifact = "MODULE_5a5161a0136e695be4d4+e1d943bc", archive({"fx/graph.py": b"compiled"})
    old = _legacy_entry(tmp_path, key, artifact)
    broken = _legacy_entry(tmp_path, "MODULE_2+3", artifact)
    (broken / "model.neff").write_bytes(artifact[:10])
    listed = _ls(tmp_path)
    assert {n: (e["state"], e["origin"]) for n, e in listed.items()} == {
        f"{LEGACY_VERSION}/{key}": ("done", TRNFLOW), f"{LEGACY_VERSION}/MODULE_2+3": ("corrupt", TRNFLOW)}

    cache = CompileCache(str(tmp_path))
    assert cache.load_artifact(entry_name(key)) == artifact  # a run's lookup finds it, checked, in the new layout
    new = tmp_path / entry_name(key)
    assert (new / "model.done").read_bytes() == b"" and (new / "model.neff").read_bytes() == artifact
    assert json.loads((new / "trnflow.json").read_text())["compile_seconds"] == 12.5
    assert (old / "model.neff").exists()  # left for an older trnflow sharing the cache
    assert cache.state(entry_name("MODULE_2+3")) == "missing"  # a broken old entry is compiled again
    assert not (tmp_path / entry_name("MODULE_2+3")).exists()

    # a run's compile backend, refusing any recompilation, loads an old entry as a hit
    warm = "MODULE_6b6272b1247f7a6cf5e5+e1d943bc"
    _legacy_entry(tmp_path, warm, artifact)
    with mock.patch.dict(os.environ):  # the compiler points TORCHINDUCTOR_CACHE_DIR at its folder
        compiler = CachedCompiler({}, cache, guard=RecompileGuard(0), inductor_dir=tmp_path / "inductor")
        assert compiler._load(warm, SimpleNamespace(data_shapes="tokens [16, 8] int64")) == ""
    assert (tmp_path / "inductor" / "fx" / "graph.py").read_bytes() == b"compiled"

    pruned = CliRunner().invoke(app, ["cache", "prune", str(tmp_path), "--other-versions", "--json"])
    assert pruned.exit_code == 0 and len(json.loads(pruned.stdout)["removed"]) == 3, pruned.output
    assert not list((tmp_path / LEGACY_VERSION).rglob("*.*")) and (new / "model.neff").exists()


def test_a_jobs_cache_is_found_as_the_compiler_wrapper_finds_it(make_spec, tmp_path):
    """One way to open a job's cache, for the jobs and for the stage that predicts their hits: the
    flags' --cache_dir, then NEURON_COMPILE_CACHE_URL, then compile.cache_url."""
    spec = make_spec()
    assert plans.job_cache(spec, env={}).url == spec.compile.cache_url
    moved = tmp_path / "elsewhere"
    assert plans.job_cache(spec, env={"NEURON_COMPILE_CACHE_URL": str(moved)}).url == moved.as_uri()
    flags = {"NEURON_CC_FLAGS": f"--optlevel=1 --cache_dir={tmp_path / 'flagged'}",
             "NEURON_COMPILE_CACHE_URL": str(moved)}
    assert plans.job_cache(spec, env=flags).url == (tmp_path / "flagged").as_uri()
