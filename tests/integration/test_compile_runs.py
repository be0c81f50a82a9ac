"""Runs against the compile cache: warm loads, the recompilation guard, and a cache on S3 (moto)."""

import json

import boto3
import pytest
from typer.testing import CliRunner

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.cli.app import app
from trnflow.settings import TrnflowSettings

SHORT = {"steps": 10, "checkpoint_every": 10, "log_every": 5}
ONE_THREAD = {"threads_per_core": 1}
"""What a run whose losses are compared bit for bit uses: one host thread (see docs/emulator.md, Cores)."""


def _run(spec, phase, run_id="r", **options):
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    processes = 1 if phase == "compile" else None
    info = wait(backend, backend.submit(JobRequest(spec, phase, run_id, processes=processes, options=options)), 0.2)
    return info


@pytest.mark.slow
def test_a_warm_run_from_an_s3_cache_compiles_nothing_and_trains_like_a_cold_one(make_spec, tmp_path, s3_bucket,
                                                                               monkeypatch, prefect_api):
    monkeypatch.setenv("TRNFLOW_CACHE_UNSIGNED", "1")  # a shared cache used unsigned, by choice: said below
    empty = {"cache_url": str(tmp_path / "empty-cache")}
    cold = _run(make_spec(cores=1, compute=ONE_THREAD, compile=empty, train=SHORT), "train", "cold")
    assert cold.state is JobState.SUCCEEDED, cold.failure
    assert cold.result.compile.hits == 0
    misses = {m.program: m for m in cold.result.compile.recompiles}
    assert set(misses) == {"train_step", "eval_step"}  # training evaluates the holdout at its end, too
    miss = misses["train_step"]
    assert miss.reason == "it is not in the compile cache"

    url = f"s3://{s3_bucket}/neuron-cache"
    spec = make_spec(cores=1, compute=ONE_THREAD, compile={"cache_url": url, "workers": 2},
                     train={**SHORT, "checkpoint_url": str(tmp_path / "warm-checkpoints")})
    compiled = _run(spec, "compile")
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    assert compiled.result.compiled == 3

    warm = _run(spec, "train", "warm")
    assert warm.state is JobState.SUCCEEDED, warm.failure
    assert (warm.result.compile.hits, warm.result.compile.recompiles) == (2, [])
    assert warm.result.loss == cold.result.loss  # the cached graph computes what the cold one did

    listing = CliRunner().invoke(app, ["cache", "ls", url, "--json"])
    assert listing.exit_code == 0, listing.output
    entries = {e["key"]: e for e in json.loads(listing.stdout)}
    assert len(entries) == 3 and {e["state"] for e in entries.values()} == {"done"}
    train_key = next(p.key for p in compiled.result.programs if p.program == "train_step")
    assert train_key == miss.key  # the same graph, keyed alike by a run on a local cache and a compile on S3
    assert entries[train_key]["hits"] == 1  # the warm run's one rank

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from trnflow.flows.compile import compile_cache

    state = compile_cache(spec, return_state=True)  # every graph a hit, known before launch
    assert state.is_completed(), state.result(raise_on_failure=False)
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details
                                                                                            .flow_run_id])))
    summary = next(a.data for a in found if a.key.endswith("-summary"))
    assert f"**Warning:** compile cache {url} is used unsigned (TRNFLOW_CACHE_UNSIGNED)" in summary

    s3 = boto3.client("s3")
    neff = f"neuron-cache/{compiled.result.compiler}/{train_key}/model.neff"
    s3.put_object(Bucket=s3_bucket, Key=neff, Body=b"truncated")
    verify = CliRunner().invoke(app, ["cache", "verify", url, "--json"])
    assert verify.exit_code == 1 and json.loads(verify.stdout)["corrupt"] == [train_key]


def test_a_batch_shape_that_changes_mid_run_is_caught_by_the_recompilation_guard(make_spec):
    spec = make_spec(train={"drop_last": False}, compile={"max_recompiles": 0})
    assert _run(spec, "compile").state is JobState.SUCCEEDED  # every static graph is in the cache
    # 1200 rows in batches of 32: the 38th step gets the 16 left over, 8 per core.
    failed = _run(spec, "train", "dynamic")
    assert failed.state is JobState.FAILED
    assert failed.failure.type == "Recompilation" and failed.failure.retryable is False
    message = failed.failure.message
    assert "train_step" in message and "tokens [8, 32] int64" in message and "drop_last" in message
