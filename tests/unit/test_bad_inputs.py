"""Bad inputs, one table: specs, data files, checkpoints, compile cache entries, command-line
arguments and the workload's own arguments. Each one must be refused with trnflow's own error (or a
non-zero exit), a message that names the input and says what to do, and nothing written.

Cases marked xfail are product defects still open; each reason says what goes wrong today."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from typer.testing import CliRunner

import trnflow.backends
import trnflow.backends.reference
import trnflow.cli.devices
import trnflow.cli.pipeline
from tests.conftest import archive, quickstart_data, tiny_m5
from tests.factories import checkpoint_meta
from trnflow.cli.app import app
from trnflow.device.base import RecompileGuard
from trnflow.device.cache import COMPILER_VERSION, CompileCache
from trnflow.emulator.jit import CachedCompiler
from trnflow.errors import ERROR_TYPES, TrnflowError
from trnflow.specs import DataSpec, SpecError
from trnflow.storage.datafiles import data_files
from trnflow.workload.__main__ import main as workload_main
from trnflow.workload.checkpoint import MARKER, RunCheckpoints, load, load_model_weights
from trnflow.workload.data import read_labelled, read_unlabelled
from trnflow.workload.programs import build_model
from trnflow.workload.recipes.m5_text.tokenizer import TextTokenizer, train_tokenizer
from trnflow.workload.sampler import StepSampler
from trnflow.workload.synth import synthesize

pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")

runner = CliRunner()
PWNED = "PWNED"
"""The file a malicious pickle would create in the test's folder."""


@dataclass(frozen=True)
class Bad:
    make: Callable[[Path], Callable[[], str]]
    """Creates the bad input under the test's folder; returns what feeds it in and gives back the refusal."""
    names: tuple[str, ...]
    """What the message must name ({tmp} is the test's folder); whitespace is ignored (Rich wraps lines)."""
    fix: str
    """A regex for the part of the message that says what to do."""
    forbid: tuple[str, ...] = ()
    leaves: tuple[str, ...] = ()
    """Files the refusal may write (a job's failure report)."""


def case(id_: str, make, *names: str, fix: str, defect: str | None = None, **extra):
    """One row. A `defect` marks it xfail on AssertionError only: code run from a pickle and files
    left behind are reported with pytest.fail, so an open defect never hides them."""
    marks = [pytest.mark.xfail(strict=True, raises=AssertionError, reason=defect)] if defect else []
    return pytest.param(Bad(make, names, fix, **extra), id=id_, marks=marks)


def refused(call: Callable[[], object]) -> str:
    """The message of the trnflow error `call` raises."""
    try:
        call()
    except (TrnflowError, SpecError) as exc:
        return str(exc)
    except Exception as exc:
        raise AssertionError(f"raised {type(exc).__name__} instead of a trnflow error: {exc}") from exc
    raise AssertionError("the bad input was accepted")


# -- the command line ------------------------------------------------------------------------------


def _invoke(argv: list[str], code: int | None) -> str:
    result = runner.invoke(app, argv)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"trnflow {' '.join(argv)} crashed: {type(result.exception).__name__}: "
                             f"{result.exception}")
    if code is None:
        assert result.exit_code != 0, f"exit 0: {result.output}"
    else:
        assert result.exit_code == code, f"exit {result.exit_code}: {result.output}"
    return result.output


def _write_spec(tmp: Path) -> None:
    """A valid spec with a little data, everything under `tmp`."""
    synthesize(tmp / "data", days=1, rows_per_day=40, seed=1)
    out = tmp / "out"
    data = quickstart_data(
        data={"train": str(tmp / "data/train"), "holdout": str(tmp / "data/holdout"),
              "inference": str(tmp / "data/inference")},
        compile={"cache_url": str(out / "cache")}, train={"checkpoint_url": str(out / "checkpoints")},
        gate={"reference": str(out / "reference.json")}, inference={"output_url": str(out / "embeddings")},
        registry_url=str(out / "registry"),
    )
    (tmp / "spec.yaml").write_text(yaml.safe_dump(data))


def cli(*args: str, code: int | None = 2, setup: Callable[[Path], object] | None = None):
    """`trnflow ARGS`; {spec} is a valid spec (with its data) in the test's folder {tmp}."""
    def make(tmp: Path):
        if any("{spec}" in a for a in args):
            _write_spec(tmp)
        if setup:
            setup(tmp)
        argv = [a.replace("{spec}", str(tmp / "spec.yaml")).replace("{tmp}", str(tmp)) for a in args]
        return lambda: _invoke(argv, code)
    return make


def spec(body: str | bytes | dict):
    """`trnflow validate` on a spec file: raw text, or a mapping dumped as YAML."""
    def make(tmp: Path):
        path = tmp / "spec.yaml"
        if isinstance(body, bytes):
            path.write_bytes(body)
        else:
            path.write_text(body if isinstance(body, str) else yaml.safe_dump(body))
        return lambda: _invoke(["validate", str(path)], 2)
    return make


# -- data files ------------------------------------------------------------------------------------

OK_ROW = '{"text": "a sturdy kettle", "label": 1}\n'


def data(files: dict[str, str | bytes | pa.Table | None], fmt: str = "jsonl", num_classes: int = 2,
         inference: bool = False):
    """The dataset folder `reviews` holding `files` (None: an empty folder), read as training data
    (or as the inference set)."""
    def make(tmp: Path):
        root = tmp / "reviews"
        for name, content in files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if content is None:
                path.mkdir()
            elif isinstance(content, pa.Table):
                pq.write_table(content, path)
            elif isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        spec = DataSpec(train=str(root), holdout=str(root), inference=str(root), format=fmt)
        if inference:
            return lambda: refused(lambda: read_unlabelled(spec.inference, spec, [spec.text_field]))
        return lambda: refused(lambda: read_labelled(data_files(spec.train, fmt), spec, [spec.text_field], num_classes,
                                                     spec.train))
    return make


def call(fn: Callable, *args):
    """A library call that needs no files."""
    return lambda tmp: lambda: refused(lambda: fn(*args))


# -- checkpoints -----------------------------------------------------------------------------------

CFG = tiny_m5()


class RunsAtLoad:
    """Unpickling this runs a shell command, as a malicious checkpoint would."""

    def __init__(self, sentinel: Path):
        self.sentinel = sentinel

    def __reduce__(self):
        return os.system, (f"touch {self.sentinel}",)


@functools.cache
def _tokenizer() -> str:
    return train_tokenizer(["a sturdy kettle", "a flimsy lamp"], 300, 8).to_json()


def _tensors(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _recommit(folder: Path, name: str, content: bytes) -> None:
    """Replace a file and its checksum in the marker: a checkpoint that passes its checksums."""
    (folder / name).write_bytes(content)
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][name] = {"sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}
    (folder / MARKER).write_text(json.dumps(marker))


def checkpoint(change: Callable[[Path, Path], object]):
    """A committed checkpoint altered by `change(folder, tmp)`, then loaded."""
    def make(tmp: Path):
        RunCheckpoints((tmp / "run").as_uri()).save(
            10, build_model(CFG, seed=0).state_dict(), {"state": {}, "param_groups": []},
            [{"torch": torch.get_rng_state()}], ("tokenizer.json", _tokenizer().encode()),
            checkpoint_meta(step=10))
        folder = tmp / "run" / "step-000010"
        change(folder, tmp)
        return lambda: refused(lambda: load(folder.as_uri()))
    return make


def weights_file(content: Callable[[Path], bytes]):
    """A plain state_dict file, `weights.pt` (what train.init_from may name), then loaded."""
    def make(tmp: Path):
        (tmp / "weights.pt").write_bytes(content(tmp))
        return lambda: refused(lambda: load((tmp / "weights.pt").as_uri()))
    return make


def weights_into_model(state: Callable[[], dict]):
    return call(lambda: load_model_weights(build_model(CFG, seed=0), state(), "file:///ckpt/model.pt"))


def _without(key: str) -> dict:
    state = build_model(CFG, seed=0).state_dict()
    del state[key]
    return state


def _marker_naming(path: str):
    def change(folder: Path, tmp: Path):
        marker = json.loads((folder / MARKER).read_text())
        marker["files"][path] = {"sha256": "0" * 64, "size": 1}
        (folder / MARKER).write_text(json.dumps(marker))
    return change


# -- compile cache entries -------------------------------------------------------------------------

KEY = "MODULE_1a2b3c+4d5e6f"
ENTRY = f"{COMPILER_VERSION}/{KEY}"


def cache_entry(change: Callable[[Path], object], where: Callable[[Path], Path] = lambda root: root,
                code: int | None = 1):
    """`trnflow cache verify` on a cache whose one done entry is altered by `change(entry folder)`."""
    def make(tmp: Path):
        root = tmp / "cache"
        CompileCache(str(root)).commit(ENTRY, "graph", {"optlevel": 1}, archive({"fx/graph.py": b"compiled"}))
        change(root / ENTRY)
        return lambda: _invoke(["cache", "verify", str(where(root))], code)
    return make


def cache_lookup(artifact: bytes | None):
    """A run's lookup of KEY with compile.max_recompiles 0, the entry holding `artifact` (None: absent)."""
    def make(tmp: Path):
        cache = CompileCache(str(tmp / "cache"))
        if artifact is not None:
            cache.commit(ENTRY, "graph", {"optlevel": 1}, artifact)
        with mock.patch.dict(os.environ):  # the compiler points TORCHINDUCTOR_CACHE_DIR at its folder
            compiler = CachedCompiler({}, cache, guard=RecompileGuard(0), inductor_dir=tmp / "inductor",
                                      program="train_step")
        graph = SimpleNamespace(data_shapes="tokens [16, 8] int64")
        return lambda: refused(lambda: compiler._load(KEY, graph))
    return make


# -- the workload program --------------------------------------------------------------------------


def _workload(argv: list[str], out: Path) -> str:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = workload_main(argv)
        except SystemExit as exc:
            code = exc.code
    assert code not in (0, None), "the workload accepted it"
    failure = out / "failure-rank0.json"
    if not failure.exists():
        return stderr.getvalue()
    report = json.loads(failure.read_text())
    assert report["type"] in ERROR_TYPES, f"failed with {report['type']}, not a trnflow error: {report['message']}"
    return report["message"]


def workload(*args: str, job: dict | None = None):
    """`python -m trnflow.workload ARGS --output {tmp}/out` in this process; `job` is written to {tmp}/job.json."""
    def make(tmp: Path):
        if job is not None:
            (tmp / "job.json").write_text(json.dumps(job))
        argv = [a.replace("{tmp}", str(tmp)) for a in args] + ["--output", str(tmp / "out")]
        return lambda: _workload(argv, tmp / "out")
    return make


FAILURE_REPORT = ("out", "out/failure-rank0.json")

# -- the table -------------------------------------------------------------------------------------

UNKNOWN = "remove it or check its spelling"
AT_LEAST_ONE = "greater than or equal to 1"
SCHEMES = "use file:// or s3://"
READ_FIX = r"\b(remove|replace|rewrite|re-export)\b"
CORRUPT_ENTRY = "the next compile rebuilds it"

CASES = [
    # Specs, through `trnflow validate`.
    case("spec-tab-indented-yaml", spec("name: x\ntrain:\n\tsteps: 3\n"), "spec.yaml", "line 3, column 1",
         fix="malformed YAML"),
    case("spec-empty-file", spec(""), "(top level)", fix="expected a mapping of sections"),
    case("spec-not-utf8", spec("name: caf\xe9\n".encode("latin-1")), "spec.yaml", "(file)", fix="not UTF-8 text"),
    case("spec-unknown-section", spec(quickstart_data(trainer={"steps": 3})), "trainer", fix=UNKNOWN),
    case("spec-unknown-field", spec(quickstart_data(compute={"gpus": 8})), "compute.gpus", fix=UNKNOWN),
    case("spec-number-where-list", spec(quickstart_data(model={"params": {"mlp_hidden": 64}})),
         "model.params.mlp_hidden", fix="should be a valid list"),
    case("spec-text-where-number", spec(quickstart_data(train={"lr": "fast"})), "train.lr",
         fix="should be a valid number"),
    case("spec-more-cores-than-trn2-has",
         spec(quickstart_data(compute={"instance_type": "trn2.48xlarge", "cores_per_node": 65})),
         "compute.cores_per_node", fix="set compute.cores_per_node <= 64"),
    case("spec-zero-nodes", spec(quickstart_data(compute={"nodes": 0})), "compute.nodes", fix=AT_LEAST_ONE),
    case("spec-negative-batch", spec(quickstart_data(train={"global_batch_size": -32})),
         "train.global_batch_size", fix=AT_LEAST_ONE),
    case("spec-negative-shard-size", spec(quickstart_data(inference={"shard_size": -1})), "inference.shard_size",
         fix=AT_LEAST_ONE),
    case("spec-negative-layer-size", spec(quickstart_data(model={"params": {"mlp_hidden": [64, -1]}})),
         "model.params.mlp_hidden", fix="every layer size must be >= 1"),
    case("spec-negative-volume", spec(quickstart_data(compute={"volume_gb": -5})), "compute.volume_gb",
         fix=AT_LEAST_ONE),
    case("spec-ftp-output-url", spec(quickstart_data(inference={"output_url": "ftp://example.com/out"})),
         "inference.output_url", "ftp", fix=SCHEMES),
    case("spec-bad-s3-bucket", spec(quickstart_data(train={"checkpoint_url": "s3://Bad_Bucket/ckpt"})),
         "train.checkpoint_url", fix=re.escape("write s3://<bucket>/<prefix>")),
    case("spec-champion-without-registry",
         spec({**quickstart_data(gate={"reference": "champion"}), "registry_url": None}), "gate.reference",
         fix="needs registry_url"),
    case("spec-kill-fault-without-step", spec(quickstart_data(faults=[{"kind": "kill", "core": 0}])), "faults",
         fix="needs `step`"),
    case("spec-missing-file", cli("validate", "{tmp}/nope.yaml"), "nope.yaml", fix="check the path"),
    case("spec-fault-on-a-core-the-instance-lacks",
         spec(quickstart_data(faults=[{"kind": "hw", "core": 9, "step": 3}])), "faults", fix="NeuronCores"),
    case("spec-cron-minute-out-of-range", spec(quickstart_data(schedule={"cron": "99 3 * * *"})), "schedule.cron",
         fix="0-59|minute"),
    case("spec-unknown-timezone",
         spec(quickstart_data(schedule={"cron": "0 3 * * *", "timezone": "Mars/Olympus"})), "schedule.timezone",
         fix="IANA"),
    case("spec-duplicate-key", spec(yaml.safe_dump(quickstart_data()) + "name: other\n"), "name",
         fix="duplicate|more than once|twice"),
    case("spec-ftp-init-from", spec(quickstart_data(train={"init_from": "ftp://host/ckpt"})), "train.init_from",
         fix=SCHEMES, forbid=("function-after", "literal[")),
    case("spec-path-is-a-folder", cli("validate", "{tmp}/specs", setup=lambda tmp: (tmp / "specs").mkdir()), "specs",
         fix="spec file|a file"),
    case("spec-missing-file-with-brackets", cli("validate", "{tmp}/spec[prod].yaml"), "spec[prod].yaml",
         fix="check the path"),
    case("spec-billion-laughs", spec("a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))), "spec.yaml", "aliases",
         fix="alias expansion refused"),
    case("spec-larger-than-1-mib", spec("name: " + "x" * (50 * 1024 * 1024) + "\n"), "spec.yaml", "(file)",
         "52,428,807 bytes", fix="1 MiB"),
    case("spec-sagemaker-checkpoints-on-local-disk",
         spec(quickstart_data(compute={"backend": "sagemaker"}, train={"checkpoint_url": "/var/ckpt"})),
         "train.checkpoint_url", "file:///var/ckpt", fix=re.escape("set train.checkpoint_url to s3://<bucket>/<prefix>")),
    case("spec-batch-memory-beyond-the-instance",
         spec(quickstart_data(compute={"backend": "batch", "instance_type": "trn1.32xlarge", "memory_gib": 1024})),
         "compute.memory_gib", "1024 GiB", "512 GiB", fix="set compute.memory_gib <= 500"),
    case("spec-fair-share-queue-without-share-identifier",
         spec(quickstart_data(compute={"backend": "batch", "instance_type": "trn1.32xlarge", "fair_share": True})),
         "compute.share_identifier", "fair-share", fix="set compute.share_identifier"),
    # Command-line arguments (nothing launches: see `_nothing_launches`).
    case("cli-set-unknown-field", cli("run", "{spec}", "--set", "train.stepz=5"), "train.stepz", fix=UNKNOWN),
    case("cli-set-wrong-type", cli("compile", "{spec}", "--set", "train.steps=many"), "train.steps",
         fix="should be a valid integer"),
    case("cli-set-without-field", cli("preflight", "{spec}", "--set", "=5"), "--set '=5'",
         fix="expected FIELD=VALUE"),
    case("cli-unknown-backend", cli("run", "{spec}", "--backend", "gcp"), "compute.backend",
         fix="should be 'local', 'sagemaker' or 'batch'"),
    case("cli-retrain-without-registry", cli("retrain", "{spec}", "--set", "registry_url=null"), "registry_url",
         fix="set registry_url"),
    case("cli-param-without-value", cli("submit", "{spec}", "--param", "run_id"), "--param 'run_id'",
         fix="expected NAME=VALUE"),
    case("cli-unknown-deployment", cli("submit", "{spec}", "--deployment", "nosuch"), "--deployment 'nosuch'",
         fix="choose one of"),
    case("cli-synth-unknown-format", cli("data", "synth", "{tmp}/synth", "--format", "xml"), "--format 'xml'",
         fix="choose jsonl, parquet, csv, amazon-polarity, prompt-completion or chat"),
    case("cli-synth-bad-start-date", cli("data", "synth", "{tmp}/synth", "--start", "2026-13-01"), "--start",
         fix="YYYY-MM-DD"),
    case("cli-synth-zero-days", cli("data", "synth", "{tmp}/synth", "--days", "0"), "--days", fix=AT_LEAST_ONE),
    case("cli-collectives-bad-size", cli("collectives", "-b", "12XB"), "'12XB'", fix="write for example"),
    case("cli-collectives-unknown-op", cli("collectives", "--op", "all_bogus"), "--op 'all_bogus'",
         fix="choose one of"),
    case("cli-cache-ftp-url", cli("cache", "ls", "ftp://host/cache"), "ftp://host/cache", fix=SCHEMES),
    case("cli-registry-ftp-url", cli("models", "ls", "-r", "ftp://host/registry"), "--registry", fix=SCHEMES),
    case("cli-set-malformed-yaml", cli("run", "{spec}", "--set", "train.steps=[1,"), "--set", "train.steps",
         fix="YAML"),
    case("cli-param-malformed-yaml", cli("submit", "{spec}", "--param", "run_id=[x"), "--param", "run_id",
         fix="YAML"),
    case("cli-bad-run-id", cli("run", "{spec}", "--run-id", "../escape"), "--run-id", fix="letters, digits"),
    case("cli-preflight-folder-run-id", cli("run", "{spec}", "--run-id", "_preflight"), "--run-id", "'_preflight'",
         fix="name the run otherwise"),
    case("cli-run-missing-data", cli("run", "{spec}", "--set", "data.train={tmp}/missing/train"), "data.train",
         fix="check the data"),
    case("cli-synth-into-a-file",
         cli("data", "synth", "{tmp}/reviews.txt", "--days", "1", "--rows-per-day", "2",
             setup=lambda tmp: (tmp / "reviews.txt").write_text("x")),
         "reviews.txt", fix="folder|directory"),
    case("cli-promote-unknown-version", cli("models", "promote", "quickstart", "3", "-r", "{tmp}/registry", code=None),
         "quickstart", fix="trnflow models ls"),
    # Data files, read as the workload reads them.
    case("data-wrong-columns", data({"p.parquet": pa.table({"body": ["x"], "stars": [1]})}, "parquet"),
         "p.parquet", "['body', 'stars']", fix="Set data.text_field / data.label_field"),
    case("data-inference-without-id", data({"p.csv": "text\nhello\n"}, "csv", inference=True), "p.csv", "'id'",
         fix="data.id_field"),
    case("data-missing-folder", data({}), "reviews", fix="check the data URLs"),
    case("data-only-empty-partitions", data({"dt=2026-01-01": None, "dt=2026-01-02": None}), "reviews",
         fix="check the data URLs"),
    case("data-wrong-extension", data({"part-0.txt": OK_ROW}), "reviews", fix="data.format"),
    case("data-zero-rows", data({"p.parquet": pa.table({"text": pa.array([], pa.string()),
                                                        "label": pa.array([], pa.int64())})}, "parquet"),
         "reviews", fix="point the spec at data that has some"),
    case("data-negative-label", data({"p.parquet": pa.table({"text": ["a", "b"], "label": [0, -1]})}, "parquet"),
         "label -1", "row 1", fix="model.params.num_classes"),
    case("data-label-beyond-num-classes", data({"p.csv": "text,label\na,0\nb,3\n"}, "csv", num_classes=3),
         "label 3", fix="model.params.num_classes"),
    case("data-null-label", data({"p.jsonl": OK_ROW + '{"text": "b", "label": null}\n'}), "'label'",
         fix="Map the labels to integers"),
    case("data-partition-not-a-date", data({"dt=2026-13-45/part-0.jsonl": OK_ROW}), "dt=2026-13-45",
         fix="name partitions dt=YYYY-MM-DD"),
    case("data-fewer-rows-than-a-batch", call(StepSampler, 10, 32, 0, 2, 1), "train.global_batch_size",
         fix="add data or lower"),
    case("data-empty-partition-file", data({"dt=2026-01-01/p.jsonl": OK_ROW * 3, "dt=2026-01-02/p.jsonl": ""}),
         "dt=2026-01-02/p.jsonl", fix=READ_FIX),
    case("data-corrupt-parquet", data({"p.parquet": b"PAR1 not really parquet"}, "parquet"), "p.parquet",
         fix=READ_FIX),
    case("data-ragged-csv", data({"p.csv": "text,label\na,1\nb\n"}, "csv"), "p.csv", fix=READ_FIX),
    case("data-not-utf8-jsonl", data({"p.jsonl": '{"text": "caf\xe9", "label": 1}\n'.encode("latin-1")}),
         "p.jsonl", fix="UTF-8"),
    case("data-not-utf8-csv", data({"p.csv": "text,label\ncaf\xe9,1\n".encode("latin-1")}, "csv"), "p.csv",
         fix="UTF-8"),
    case("data-bad-label-in-second-partition",
         data({"dt=2026-01-01/p.jsonl": OK_ROW * 5, "dt=2026-01-02/p.jsonl": '{"text": "x", "label": 7}\n'}),
         "dt=2026-01-02", fix="model.params.num_classes"),
    case("data-label-types-differ",
         data({"dt=2026-01-01/p.jsonl": OK_ROW, "dt=2026-01-02/p.jsonl": '{"text": "x", "label": "pos"}\n'}),
         "dt=2026-01-02", fix="integer"),
    case("data-polarity-label-0", data({"p.csv": '"0","title","content"\n'}, "amazon-polarity"), "p.csv",
         fix="label 1 or 2"),
    # Checkpoints.
    case("ckpt-no-commit-marker", checkpoint(lambda f, tmp: (f / MARKER).unlink()), "step-000010",
         fix="pick another checkpoint"),
    case("ckpt-checksum-mismatch", checkpoint(lambda f, tmp: (f / "optim.pt").write_bytes(b"changed")),
         "optim.pt", fix="use an earlier one"),
    case("ckpt-marker-not-json", checkpoint(lambda f, tmp: (f / MARKER).write_text("{oops")), MARKER,
         fix="Use an earlier one or retrain"),
    case("ckpt-listed-file-missing", checkpoint(lambda f, tmp: (f / "optim.pt").unlink()), "optim.pt",
         fix="check the checkpoint URL"),
    case("ckpt-state-without-rng", checkpoint(lambda f, tmp: _recommit(f, "state.pt", _tensors({"step": 3}))),
         "state.pt", fix="use an earlier checkpoint"),
    case("ckpt-weights-missing-key", weights_into_model(lambda: _without("head.0.weight")), "model.pt",
         "head.0.weight", fix="check the model section"),
    case("ckpt-values-not-tensors", weights_file(lambda tmp: _tensors({"w": [1, 2]})), "weights.pt",
         fix="expected a state_dict"),
    case("ckpt-tokenizer-garbage", call(TextTokenizer.from_json, "{}", 8, 300, "file:///ckpt/tokenizer.json"),
         "tokenizer.json", fix="remove it or train from scratch"),
    case("ckpt-file-missing", call(load, "file:///nowhere/weights.pt"), "weights.pt", fix="check the checkpoint URL"),
    case("ckpt-pickled-os-system",
         checkpoint(lambda f, tmp: _recommit(f, "model.pt", _tensors({"weight": RunsAtLoad(tmp / PWNED)}))),
         "model.pt", fix="(?i)re-?save", forbid=("set to `False`",)),
    case("ckpt-pickled-object-file", weights_file(lambda tmp: pickle.dumps(RunsAtLoad(tmp / PWNED))), "weights.pt",
         fix="(?i)re-?save", forbid=("set to `False`",)),
    case("ckpt-truncated-file", weights_file(lambda tmp: _tensors(build_model(CFG, seed=0).state_dict())[:200]),
         "weights.pt", fix="copy it again|earlier"),
    case("ckpt-weights-wrong-shape",
         weights_into_model(lambda: build_model(tiny_m5(num_classes=5), seed=0).state_dict()),
         "model.pt", "head.3.weight", fix="model.params"),
    case("ckpt-meta-not-json", checkpoint(lambda f, tmp: _recommit(f, "meta.json", b"{not json")), "meta.json",
         fix="earlier"),
    case("ckpt-meta-not-a-mapping", checkpoint(lambda f, tmp: _recommit(f, "meta.json", b"[1, 2]")), "meta.json",
         fix="earlier"),
    case("ckpt-step-not-a-number",
         checkpoint(lambda f, tmp: _recommit(f, "state.pt", _tensors({"step": "ten", "rng": []}))), "state.pt",
         fix="earlier"),
    case("ckpt-tokenizer-not-utf8", call(lambda: tiny_m5().load(b"\xff\xfe", "file:///ckpt/step-000010")),
         "tokenizer.json", fix="earlier"),
    case("ckpt-marker-names-a-file-outside", checkpoint(_marker_naming("../../secret.pt")), MARKER,
         fix="earlier"),
    # Compile cache entries.
    case("cache-truncated-artifact", cache_entry(lambda e: (e / "model.neff").write_bytes(b"comp")), KEY,
         fix=CORRUPT_ENTRY),
    case("cache-done-record-not-json", cache_entry(lambda e: (e / "model.done").write_text("{")), KEY,
         fix=CORRUPT_ENTRY),
    case("cache-artifact-missing", cache_entry(lambda e: (e / "model.neff").unlink()), KEY, fix=CORRUPT_ENTRY),
    case("cache-entry-missing", cache_lookup(None), KEY, "train_step", fix="run `trnflow compile SPEC`"),
    case("cache-done-record-wrong-shape", cache_entry(lambda e: (e / "model.done").write_text('{"files": []}')),
         KEY, fix=CORRUPT_ENTRY),
    case("cache-lock-record-garbled",
         cache_entry(lambda e: ((e / "model.done").unlink(),
                                (e / "model.lock").write_text('{"pid": 1, "host": "elsewhere", "since": "noon"}')),
                     code=None),
         KEY, "model.lock", fix=r"\b(remove|delete|prune)\b"),
    case("cache-path-missing", cache_entry(lambda e: None, where=lambda root: root.parent / "no-cache", code=None),
         "no-cache", fix="check|no such"),
    case("cache-version-folder-given",
         cache_entry(lambda e: None, where=lambda root: root / COMPILER_VERSION, code=None), COMPILER_VERSION,
         fix="parent|layout"),
    case("cache-artifact-not-an-archive", cache_lookup(b"not a tar archive"), KEY, fix="trnflow compile"),
    # The workload program's own arguments.
    case("workload-bad-run-id", workload("train", "--run-id", "../x"), "--run-id", "'../x'",
         fix="use letters, digits"),
    case("workload-unknown-phase", workload("deploy"), "'deploy'", fix="choose from"),
    case("workload-spec-missing", workload("train", "--spec", "{tmp}/job.json"), "job.json", fix="check",
         leaves=FAILURE_REPORT),
    case("workload-spec-invalid", workload("train", "--spec", "{tmp}/job.json",
                                           job=quickstart_data(train={"steps": 0})),
         "job.json", "train.steps", fix=AT_LEAST_ONE, leaves=FAILURE_REPORT),
]


@pytest.fixture(autouse=True)
def _nothing_launches(monkeypatch):
    """A bad input must be refused before any job or flow starts."""
    def launched(*args, **kwargs):
        raise AssertionError("a job or flow was launched")

    monkeypatch.setattr(trnflow.cli.pipeline, "_run_flow", launched)
    for module in (trnflow.backends, trnflow.backends.reference, trnflow.cli.pipeline, trnflow.cli.devices):
        monkeypatch.setattr(module, "run_to_end", launched)


def _files(root: Path) -> dict[str, tuple[int, int] | None]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in root.rglob("*")}


def _squash(text: str) -> str:
    return "".join(text.split())


@pytest.mark.parametrize("bad", CASES)
def test_a_bad_input_is_refused_naming_it_and_the_fix(bad, tmp_path):
    feed = bad.make(tmp_path)
    before = _files(tmp_path)
    message = " ".join(feed().split())
    if (tmp_path / PWNED).exists():
        pytest.fail("loading the checkpoint ran the code pickled in it")
    after = _files(tmp_path)
    written = sorted(p for p, state in after.items() if before.get(p, "new") != state and p not in bad.leaves)
    if written:
        pytest.fail(f"left new or changed files behind: {written}")
    for name in bad.names:
        name = name.replace("{tmp}", str(tmp_path))
        assert _squash(name) in _squash(message), f"{name!r} is not named in: {message}"
    assert re.search(bad.fix, message), f"no fix ({bad.fix}) in: {message}"
    for phrase in ("Traceback", *bad.forbid):
        assert phrase not in message, f"{phrase!r} in: {message}"
