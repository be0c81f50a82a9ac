"""Shared fixtures: a small synthetic dataset, quickstart-shaped specs, and one Prefect API per session."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from trnflow.specs import JobSpec, validate_spec
from trnflow.workload.synth import synthesize

# The XLA lane runs in its own environment (`make test-xla`); a plain `pytest` elsewhere leaves it out.
collect_ignore = [] if importlib.util.find_spec("torch_xla") or os.environ.get("TRNFLOW_LANE_DEVICE") else ["xla"]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "jobspecs" / "examples"

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# The tests own their emulated cores: nothing else on this machine can hold them, not even the other
# test process of `pytest -n 2` (each has its own folder).
os.environ["TRNFLOW_NEURON_RT_DIR"] = tempfile.mkdtemp(prefix="trnflow-rt-")
atexit.register(shutil.rmtree, os.environ["TRNFLOW_NEURON_RT_DIR"], ignore_errors=True)
# The test processes of `pytest -n N` share this machine's CPUs, and so do the jobs they start: each
# process's jobs get its share for their ranks' threads (TRNFLOW_HOST_CPUS), and so does its own
# tensor work (`pytest_configure`). With threads for every CPU in each, two one-core trainings at
# once on 2 CPUs took 1.6 times as long as with one thread each (alone, one thread trains as fast as two).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    os.environ.setdefault("TRNFLOW_HOST_CPUS", str(max(1, (os.cpu_count() or 1) // WORKERS)))


def pytest_configure(config):
    if WORKERS > 1:
        import torch

        torch.set_num_threads(int(os.environ["TRNFLOW_HOST_CPUS"]))


# The longest files, longest first, by their tests' summed durations in a measured run (the timeline
# of `make test`: runs/test-timeline; docs/testing.md). `make test` hands whole files to its two
# workers (`--dist loadfile`, in this order), so these start first and the run ends on short ones,
# not with one worker busy on a long file while the other has nothing left.
LONGEST_FILES = ("test_make_targets.py", "test_tensor_parallel.py", "test_cloud_nodes.py", "test_prefect_server.py",
                 "test_cloud_batch.py", "test_queue.py", "test_serving.py", "test_image_install.py",
                 "test_causal_lm.py", "test_cloud_sagemaker.py", "test_recipe_pipelines.py", "test_stack_queue.py",
                 "test_lora.py", "test_cloud_sharded.py", "test_tracking.py", "test_forecast.py", "test_pipeline.py",
                 "test_sharded.py", "test_fault_matrix.py", "test_faults.py", "test_inference.py",
                 "test_fault_matrix_sharded.py", "test_mock_aws_docs.py", "test_readme.py")


def pytest_collection_modifyitems(items):
    """A test's folder is its kind: tests/unit are quick checks of one part in this process (`make
    test-fast`); tests/integration start jobs, flows, servers or clouds. The longest files run first."""
    for item in items:
        parts = Path(str(item.path)).parts
        for kind in ("unit", "integration"):
            if kind in parts:
                item.add_marker(kind)
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.path)).name, len(LONGEST_FILES)))  # stable: file order kept


def archive(files: dict[str, bytes]) -> bytes:
    """A gzipped tar of `files` (name -> content), shaped like a compile artifact."""
    import io
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


# What the checkout may gain while tests run: environments, bytecode and the test tools' own caches
# (`make test` installs the XLA lane's environment beside the first tests), never a run's outputs.
NOT_OUTPUTS = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis", "build"}
TIMELINE = ("runs", "test-timeline")
"""Where `make test` keeps its timeline (tests/timeline.py), written by make and pytest, not by tests."""


def checkout_files(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under the checkout that a test could have written, with its size and mtime. The
    folders no test writes to (`.venv` with its gigabytes of packages, `.git`, caches) are not walked."""
    found = {}
    for top, dirs, files in os.walk(folder):
        here = Path(top).relative_to(folder)
        dirs[:] = [d for d in dirs if d not in NOT_OUTPUTS and not d.endswith(".egg-info")
                   and (here / d).parts != TIMELINE]
        for name in files:
            path = Path(top) / name
            if not path.is_file():
                continue
            stat = path.stat()
            found[(here / name).as_posix()] = (stat.st_size, stat.st_mtime_ns)
    return found


def changed(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """The files added, changed or deleted between two `checkout_files` readings."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


@pytest.fixture(scope="session", autouse=True)
def _checkout_untouched():
    """Tests write under their own temporary folders, never into the checkout: not into the `runs/`
    and `.trnflow/` that `make demo` has just filled (where the examples' relative paths point), nor
    anywhere else. A test that adds, changes or deletes a file there fails the session here."""
    before = checkout_files(ROOT)
    yield
    touched = changed(before, checkout_files(ROOT))
    assert not touched, f"tests wrote into the checkout {ROOT}: {touched[:8]} (give the test a temporary path)"


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path_factory, monkeypatch):
    """Each test runs in a new empty folder, so a relative path (the examples' `runs/...`, the default
    `.trnflow` home) names nothing a newcomer's `make demo` left in the checkout."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data")
    synthesize(out, days=2, rows_per_day=600, seed=3, holdout_rows=400, inference_rows=350)
    return out


@pytest.fixture(scope="session")
def decoder(tmp_path_factory, dataset) -> Path:
    """A tiny Llama-style decoder with its own tokenizer, learned from the session dataset's texts: the
    pretrained folder the LoRA and tensor-parallel tests fine-tune."""
    import pyarrow.parquet as pq

    from tests.pretrained import tiny_causal_lm

    texts = [str(t) for f in sorted((dataset / "train").rglob("*.parquet")) for t in pq.read_table(f)["text"]]
    return tiny_causal_lm(tmp_path_factory.mktemp("base") / "decoder", texts[:2000])


@pytest.fixture(scope="session")
def trnflow_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("trnflow-home")
    os.environ["TRNFLOW_HOME"] = str(home)
    os.environ["TRNFLOW_POLL_SECONDS"] = "0.2"
    return home


ON_S3 = {"data": {"train": "s3://acme-data/reviews/train", "holdout": "s3://acme-data/reviews/holdout",
                  "inference": "s3://acme-data/reviews/inference"},
         "compile": {"cache_url": "s3://acme-data/neuron-cache"}, "inference": {"output_url": "s3://acme-data/out"}}
"""The quickstart's job locations on S3 (with `train.checkpoint_url`), as a cloud backend needs them."""


def quickstart_data(**sections) -> dict:
    """The quickstart example as a mapping, with sections replaced or updated (`model={"params":
    {...}}` updates the recipe's params; with another `recipe`, they are that recipe's alone)."""
    data = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(data.get(name), dict):
            other_recipe = values.get("recipe", data[name].get("recipe")) != data[name].get("recipe")
            base = {} if other_recipe else data[name].get("params", {})  # another recipe: its own params only
            params = {**base, **values["params"]} if "params" in values else ({} if other_recipe else None)
            data[name] = {**data[name], **values, **({"params": params} if params is not None else {})}
        else:
            data[name] = values
    return data


def tiny_m5(**params):
    """The built-in m5-text recipe with a model small enough for unit tests (params override)."""
    from trnflow.specs import validate_spec
    from trnflow.workload.recipes import recipe_for

    small = {"vocab_size": 300, "d_model": 16, "n_heads": 2, "n_layers": 1, "ffn_dim": 32, "mlp_hidden": [8],
             "seq_len": 8, "num_classes": 2, "dropout": 0.1}
    return recipe_for(validate_spec(quickstart_data(model={"params": {**small, **params}})))


def once_per_run(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, made by `make(folder)` once for the whole pytest run: xdist's workers share
    their base temporary folder's parent, and the first worker to ask makes it under a file lock
    while the other waits. Marked made last, so a worker that failed half way leaves it to be made
    again; what is made must be deterministic, as whichever worker comes first makes it."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, made = root / f"run-{name}", root / f"run-{name}.made"
    with (root / f"run-{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


def warm(cache_folder: Path, dataset: Path, out: Path) -> None:
    """Fill `cache_folder` with the graphs of `make_spec`'s model and their plan, each entry signed
    with the mock cloud's key (so that it holds hits on the emulated services too): one compile job."""
    from tests.faults.world import patched_env
    from trnflow.backends import JobRequest, JobState, wait
    from trnflow.backends.local import LocalBackend
    from trnflow.device import plans
    from trnflow.device.cache import DONE, CompileCache, entry_name
    from trnflow.device.signing import SIGNING_KEY_ENV, EntryKeys
    from trnflow.settings import TrnflowSettings
    from trnflow.testing.mockcloud.provision import signing_key, signing_pem
    from trnflow.workload.memory import decided
    from trnflow.workload.recipes import plan_digest

    spec = decided(validate_spec(quickstart_data(
        data={"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
              "inference": str(dataset / "inference")},
        compile={"cache_url": str(cache_folder)}, train={"checkpoint_url": str(out / "checkpoints")},
        gate={"reference": None}, inference={"output_url": str(out / "embeddings")},
        registry_url=str(out / "registry"))))
    pem = out / "cache.pem"
    pem.write_text(signing_pem())
    pem.chmod(0o600)
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    with patched_env({SIGNING_KEY_ENV: str(pem)}):  # the compile job signs what it writes
        job = wait(backend, backend.submit(JobRequest(spec, "compile", "warm", processes=1)), 0.2)
    assert job.state is JobState.SUCCEEDED, job.failure
    cache = CompileCache(str(cache_folder), keys=EntryKeys(trusted=signing_key().public_key()))
    recorded = plans.recorded(cache, plan_digest(spec))
    assert recorded and {cache.state(entry_name(row.key)) for row in recorded} == {DONE}
    assert not any(cache.signature_problem(entry_name(row.key)) for row in recorded)


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> Path:
    """This worker's compile cache, shared by its tests: empty until `warm_compile_cache` (which
    every integration test has) fills it."""
    return tmp_path_factory.mktemp("compile-cache")


@pytest.fixture(scope="session")
def warmed_cache(dataset, trnflow_home, tmp_path_factory) -> Path:
    """The compile cache warmed once for the whole pytest run, holding the graphs of `make_spec`'s
    model and nothing else (see `warm`): to copy or upload, never to write (the other worker reads it)."""
    def make(folder: Path) -> None:
        (folder / "cache").mkdir()
        warm(folder / "cache", dataset, folder)

    return once_per_run(tmp_path_factory, "warm-compile-cache", make) / "cache"


@pytest.fixture(scope="session")
def warm_compile_cache(compile_cache, warmed_cache) -> Path:
    """The worker's compile cache, a copy of `warmed_cache`, so that no worker compiles those graphs
    again: its tests add their own graphs to it, without touching the other worker's."""
    shutil.copytree(warmed_cache, compile_cache, dirs_exist_ok=True)
    return compile_cache


@pytest.fixture
def make_spec(dataset, tmp_path, trnflow_home, compile_cache):
    """A small quickstart spec whose data is the session dataset and whose outputs go to tmp_path."""

    def make(cores: int = 2, **sections) -> JobSpec:
        """`cores` NeuronCores (ranks), 16 samples a core a step: the same graphs on any number of
        cores. A test about the pipeline's logic, not about ranks, asks for 1: half the processes."""
        base = {
            "data": {"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
                     "inference": str(dataset / "inference")},
            "compute": {"cores_per_node": cores},
            "train": {"steps": 40, "checkpoint_every": 20, "log_every": 10, "global_batch_size": 16 * cores,
                      "checkpoint_url": str(tmp_path / "checkpoints")},
            "compile": {"cache_url": str(compile_cache)},
            "gate": {"reference": str(tmp_path / "reference" / "metrics.json")},
            "inference": {"output_url": str(tmp_path / "embeddings"), "shard_size": 100},
            "registry_url": str(tmp_path / "registry"),
        }
        for name, values in sections.items():
            base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
        return validate_spec(quickstart_data(**base))

    return make


@pytest.fixture(scope="session")
def prefect_api() -> str:
    """One real Prefect API (SQLite) for the whole session; starting one takes several seconds.
    Yields its URL, for the `trnflow` commands a test runs in processes of their own. Started up to
    three times: Prefect's start-up probe retries a refused connection but not one reset or left
    unanswered, which a server starved of CPU gives now and then (the XLA lane's processes run at
    nice 19 beside the other tests; both of its workers failed so once)."""
    import httpx
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with contextlib.ExitStack() as stack:
        for attempt in range(3):
            try:
                stack.enter_context(prefect_test_harness(server_startup_timeout=120))
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
                from prefect.server.api.server import SubprocessASGIServer

                left = getattr(SubprocessASGIServer, "_instances", {}).get(None)  # the harness's, registered first
                if left is not None:
                    left.stop()  # Prefect leaves the server it could not reach running
        url = PREFECT_API_URL.value()
        assert url, "the Prefect test harness set no API URL"
        yield url


@pytest.fixture
def in_process_aws(monkeypatch):
    """moto in this process, with placeholder credentials and no endpoint override."""
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        yield


@pytest.fixture(scope="session")
def moto_endpoint():
    """A real moto server on 127.0.0.1, so that worker processes reach the same fake AWS."""
    import logging
    import socket

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(moto_endpoint, monkeypatch) -> str:
    """A fresh bucket on the moto server; this process and the jobs it launches talk to it."""
    import uuid

    import boto3

    for name, value in {"AWS_ENDPOINT_URL": moto_endpoint, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    bucket = f"trnflow-test-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return bucket
