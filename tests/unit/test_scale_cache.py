"""A compile cache of 10,000 entries: `trnflow cache ls` lists every one with its state, size and hit
count from one listing and the version folder's index, never reading an artifact; a warm check reads
only its own entries; and the index follows entries added, removed, hit or damaged behind its back,
on a directory and on S3. The speed goals are in benchmarks/scale_cache.py, not here."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from moto import mock_aws
from typer.testing import CliRunner

from tests.conftest import ROOT
from trnflow import aws
from trnflow.cli.app import app
from trnflow.device import cache as cache_module
from trnflow.device import plans
from trnflow.device.cache import (
    COMPILER_VERSION,
    CORRUPT,
    DONE,
    MISSING,
    CompileCache,
    entry_name,
)
from trnflow.device.cache_entry import LEGACY_VERSION
from trnflow.device.cache_index import INDEX, INDEX_FORMAT
from trnflow.measures import ProgramPlan
from trnflow.storage import LocalStore, S3Store

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark builds its cache the same way
from scale_cache import NEURON_VERSION, Built, build_cache

pytestmark = pytest.mark.slow  # building 10,000 entries: `make test` runs these, `make test-fast` leaves them out

ENTRIES = 10_000
HOUR = 3600.0


def _age(root: Path, seconds: float) -> None:
    """Date every file of the cache `seconds` back, as if written that long ago."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            stat = os.stat(path)
            os.utime(path, (stat.st_atime - seconds, stat.st_mtime - seconds))


def _on_disk(root: Path, entry: str) -> int:
    """The bytes of an entry's files, summed from the file system itself."""
    with os.scandir(root / entry) as files:
        return sum(f.stat().st_size for f in files if f.is_file() and not f.name.endswith(".tmp"))


@pytest.fixture(autouse=True)
def _settled_at_once(monkeypatch):
    """The index keeps what a listing read however recent its files (a listing otherwise leaves out
    files written within `SETTLE_SECONDS` of its newest object, and reads them again; one test shows it)."""
    monkeypatch.setattr(cache_module, "SETTLE_SECONDS", 0.0)


@pytest.fixture(scope="module")
def big() -> tuple[Path, Built]:
    """10,000 entries (in memory where the machine has a tmpfs: a disk can take far longer to create
    their 60,000 files than this test should)."""
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(prefix="trnflow-scale-", dir=shm if shm.is_dir() else None) as tmp:
        root = Path(tmp) / "cache"
        yield root, build_cache(root, ENTRIES)


@pytest.fixture
def reads(monkeypatch) -> dict[str, list[str]]:
    """Every name the directory store reads and every prefix it lists, and every file opened at all."""
    seen: dict[str, list[str]] = {"read": [], "list": [], "opened": []}
    read, listing, opener = LocalStore.read, LocalStore.list, open

    def counted_read(self, name: str) -> bytes:
        seen["read"].append(name)
        return read(self, name)

    def counted_list(self, prefix: str = ""):
        seen["list"].append(prefix)
        return listing(self, prefix)

    def counted_open(file, *args, **kwargs):
        seen["opened"].append(os.fspath(file) if isinstance(file, str | os.PathLike) else repr(file))
        return opener(file, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "read", counted_read)
    monkeypatch.setattr(LocalStore, "list", counted_list)
    monkeypatch.setattr("builtins.open", counted_open)
    monkeypatch.setattr("io.open", counted_open)
    return seen


def _ls(root: Path | str) -> dict[str, dict]:
    result = CliRunner().invoke(app, ["cache", "ls", str(root), "--json"])
    assert result.exit_code == 0, result.output
    return {f"{e['compiler']}/{e['key']}": e for e in json.loads(result.stdout)}


def _small_files_read(names: list[str]) -> set[str]:
    """The entries whose own files were read (a lock record aside: a lock's holder is checked live)."""
    return {name.rsplit("/", 1)[0] for name in names if not name.endswith(("/model.lock", f"/{INDEX}"))}


def test_ls_lists_ten_thousand_entries_with_their_states_sizes_and_hits_and_reads_no_artifact(big, reads):
    root, built = big
    listed = _ls(root)
    assert len(listed) == ENTRIES
    assert {name: e["state"] for name, e in listed.items()} == built.states
    assert {name: e["hits"] for name, e in listed.items()} == built.hits
    assert all(e["bytes"] == _on_disk(root, name) for name, e in listed.items())
    assert {e["origin"] for name, e in listed.items() if name.startswith(NEURON_VERSION)} == {"neuronx-cc"}
    assert reads["list"] == [""]  # one listing of the whole cache
    assert not any(name.endswith(("model.neff", "model.fx.txt", "compile_flags.json")) for name in reads["read"])
    assert not any(path.endswith("model.neff") for path in reads["opened"])
    assert (root / COMPILER_VERSION / INDEX).is_file() and not (root / NEURON_VERSION / INDEX).exists()


def test_a_listing_with_its_index_reads_no_entry_and_prints_every_one(big, reads):
    root, built = big
    CompileCache(str(root)).entries()  # the index is there after any listing
    reads["read"].clear()
    result = CliRunner().invoke(app, ["cache", "ls", str(root)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["compiler", "key", "state", "size", "hits", "last", "used", "written", "by"]
    assert len(lines) == 1 + ENTRIES
    assert sorted(line.split()[2] for line in lines[1:]) == sorted(built.states.values())
    assert _small_files_read(reads["read"]) == set()  # only the index, and the lock records of locked entries
    assert not any(path.endswith("model.neff") for path in reads["opened"])


def test_the_command_lists_the_cache_without_loading_the_rest_of_the_app(big):
    """`trnflow cache` starts on its own (trnflow.cli.main): the same listing as the whole app's,
    without the job specs and their models, the backends, Prefect or the report modules."""
    root, _ = big
    probe = (
        "import json, sys\n"
        "from trnflow.cli.main import main\n"
        f"sys.argv = ['trnflow', 'cache', 'ls', {str(root)!r}, '--json']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "heavy = ('prefect', 'torch', 'trnflow.specs', 'trnflow.cli.app', 'trnflow.results', 'trnflow.reporting',\n"
        "         'trnflow.backends', 'trnflow.settings')\n"
        "sys.stderr.write(json.dumps(sorted(m for m in sys.modules if m.startswith(heavy))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stderr) == []
    assert {f"{e['compiler']}/{e['key']}": e for e in json.loads(done.stdout)} == _ls(root)
    usage = subprocess.run([sys.executable, "-m", "trnflow.cli", "cache", "ls", "--help"], capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 0 and "Usage: trnflow cache ls [OPTIONS]" in usage.stdout, usage.stdout


def test_a_bit_flip_is_done_in_the_listing_and_corrupt_when_verified(big):
    root, built = big
    cache = CompileCache(str(root))
    flipped = [name for name, state in built.verified.items() if state == CORRUPT and built.states[name] == DONE]
    assert len(flipped) == ENTRIES // 1000
    assert {cache.state(name, deep=True) for name in flipped} == {CORRUPT}
    assert {cache.state(name) for name in flipped} == {DONE}  # sizes as recorded: only checksums tell


def test_a_warm_check_of_a_few_keys_reads_only_their_entries(big, reads):
    root, built = big
    wanted = [*built.done[:3], next(n for n, s in built.states.items() if s == MISSING)]
    rows = [ProgramPlan(program=f"program_{i}", key=name.split("/")[1]) for i, name in enumerate(wanted)]
    prediction = plans.predict(rows, CompileCache(str(root)), retry_failed=False)
    assert [row.state for row in prediction] == [built.states[name] for name in wanted]
    assert [row.will for row in prediction] == ["hit", "hit", "hit", "compile"]
    assert reads["list"] == [f"{name}/" for name in wanted]
    legacy = {f"{LEGACY_VERSION}/{name.split('/')[1]}" for name in wanted}  # a miss looks for an old entry
    assert _small_files_read(reads["read"]) <= set(wanted) | legacy
    assert not any(name.endswith("model.neff") for name in reads["read"])


def _small(tmp_path: Path) -> tuple[Path, Built]:
    """40 entries of every kind, written an hour ago."""
    root = tmp_path / "cache"
    built = build_cache(root, 40)
    _age(root, HOUR)
    return root, built


def test_the_index_follows_entries_added_removed_hit_and_damaged_behind_its_back(tmp_path, reads):
    root, built = _small(tmp_path)
    cache = CompileCache(str(root))
    assert {f"{e.compiler}/{e.key}": e.state for e in cache.entries()} == built.states
    reads["read"].clear()
    cache.entries()
    assert _small_files_read(reads["read"]) == set()

    done = built.done
    added = entry_name("MODULE_00000000000000000000+00000000")
    CompileCache(str(root)).commit(added, "graph", {"optlevel": 2}, b"\x1f\x8b artifact")  # no index touched
    shutil.rmtree(root / done[0])
    CompileCache(str(root)).record_hit(done[1])
    with open(root / done[2] / "model.neff", "r+b") as neff:  # in no index row: the listed size tells
        neff.truncate(10)
    CompileCache(str(root)).discard(done[3])
    reads["read"].clear()
    listed = {f"{e.compiler}/{e.key}": e for e in cache.entries()}
    assert done[0] not in listed and listed[added].state == DONE
    assert listed[done[1]].hits == built.hits[done[1]] + 1
    assert listed[done[2]].state == CORRUPT and listed[done[3]].state == MISSING
    assert len(listed) == len(built.states)  # one removed, one added
    changed = {added, done[1]} | ({done[3]} if built.hits[done[3]] else set())  # a discarded entry keeps its usage
    assert _small_files_read(reads["read"]) == changed  # only what changed is read again

    rows = json.loads((root / COMPILER_VERSION / INDEX).read_text())["entries"]
    assert done[0].split("/")[1] not in rows and added.split("/")[1] in rows
    reads["read"].clear()
    assert {f"{e.compiler}/{e.key}": e.state for e in cache.entries()} == {n: e.state for n, e in listed.items()}
    assert _small_files_read(reads["read"]) == set()


def test_a_file_just_written_is_read_again_until_it_has_settled(tmp_path, monkeypatch, reads):
    monkeypatch.setattr(cache_module, "SETTLE_SECONDS", HOUR)
    root, built = _small(tmp_path)
    cache = CompileCache(str(root))
    cache.entries()  # no file is an hour older than the newest yet: the index is written, with no rows
    cache.entries()  # the index is the newest object now: every row is kept
    reads["read"].clear()
    cache.entries()
    assert _small_files_read(reads["read"]) == set()

    hit = built.done[0]
    cache.record_hit(hit)  # a rewrite this recent could come again at the same size and time: not kept
    for _ in range(2):
        reads["read"].clear()
        assert {f"{e.compiler}/{e.key}": e.hits for e in cache.entries()}[hit] == built.hits[hit] + 1
        assert _small_files_read(reads["read"]) == {hit}


def test_a_garbled_missing_or_unwritable_index_never_changes_the_listing(tmp_path, monkeypatch):
    root, built = _small(tmp_path)
    index = root / COMPILER_VERSION / INDEX
    expected = {name: (e["state"], e["hits"], e["bytes"]) for name, e in _ls(root).items()}
    assert {name: state for name, (state, _, _) in expected.items()} == built.states
    for garbage in ("{not json", '{"format": 1, "entries": {"MODULE_x": 7}}', '{"format": 99, "entries": {}}',
                    json.dumps({"format": 1, "entries": {k: [[None, None, None], None, "many", None]
                                                         for k in json.loads(index.read_text())["entries"]}})):
        index.write_text(garbage)
        assert {name: (e["state"], e["hits"], e["bytes"]) for name, e in _ls(root).items()} == expected
        assert json.loads(index.read_text())["format"] == INDEX_FORMAT  # written again, whole
    index.unlink()
    assert {name: (e["state"], e["hits"], e["bytes"]) for name, e in _ls(root).items()} == expected

    def refused(self, name: str, data: bytes) -> None:
        raise PermissionError(f"{name}: read-only")

    index.unlink()
    monkeypatch.setattr(LocalStore, "write", refused)
    assert {name: (e["state"], e["hits"], e["bytes"]) for name, e in _ls(root).items()} == expected
    assert not index.exists()


def test_pruning_drops_the_removed_entries_from_the_index(tmp_path):
    root, built = _small(tmp_path)
    cache = CompileCache(str(root))
    cache.entries()
    removed = {f"{e.compiler}/{e.key}" for e in cache.prune(COMPILER_VERSION, failed=True)}
    assert removed == {name for name, state in built.verified.items() if state in ("failed", "corrupt")}
    rows = json.loads((root / COMPILER_VERSION / INDEX).read_text())["entries"]
    assert not {name.split("/")[1] for name in removed} & set(rows)


def test_on_s3_the_index_is_one_object_and_the_listing_stays_the_truth(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        aws.client("s3").create_bucket(Bucket="cache-bucket")
        store = S3Store("s3://cache-bucket/shared")
        read = store.read
        names: list[str] = []

        def counted(name: str) -> bytes:
            names.append(name)
            return read(name)

        store.read = counted
        cache = CompileCache(store.url, store=store)
        keys = [entry_name(f"MODULE_{n:020d}+0000000{n}") for n in range(3)]
        for key in keys:
            cache.commit(key, "graph", {"optlevel": 2}, b"\x1f\x8b artifact")
        cache.record_hit(keys[0])
        assert [(e.state, e.hits) for e in cache.entries()] == [(DONE, 1), (DONE, 0), (DONE, 0)]
        names.clear()
        assert [(e.state, e.hits) for e in cache.entries()] == [(DONE, 1), (DONE, 0), (DONE, 0)]
        assert names == [f"{COMPILER_VERSION}/{INDEX}"]
        store.delete(f"{keys[1]}/model.neff")  # removed behind the index's back: the listing is the truth
        assert [e.state for e in cache.entries()] == [DONE, CORRUPT, DONE]


def test_an_index_row_is_typed_and_a_malformed_one_is_read_again_from_its_entry():
    from trnflow.device.cache_index import INDEXED, Index, IndexRow

    good = IndexRow(stamp=((10, 1.0), None, (40, 2.0)), sizes=None, hits=3, last_used=2.5)
    assert len(INDEXED) == 3 and IndexRow.model_validate(json.loads(good.model_dump_json())) == good
    index = Index({"MODULE_a": good.model_dump(mode="json"),
                    "MODULE_b": {**good.model_dump(mode="json"), "hits": "3"},  # hand-edited: a string
                    "MODULE_c": [[[10, 1.0], None, [40, 2.0]], None, 3, 2.5]}, settled_before=100.0)  # format 1
    assert list(index.kept) == ["MODULE_a"]  # the others are read from their entries again
    with pytest.raises(ValueError, match="stamp: 2 files"):
        IndexRow(stamp=((1, 1.0), None), sizes=None, hits=0, last_used=None)
