"""Offline batch inference: a run killed midway and rerun, torn shards, and the manifest."""

import hashlib
import json

import pyarrow.parquet as pq
import pytest

from tests.factories import checkpoint_meta
from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.storage import local_path


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _job(backend, spec, phase, run_id, checkpoint=None):
    return wait(backend, backend.submit(JobRequest(spec, phase, run_id, checkpoint=checkpoint)), 0.2)


def _checksums(out) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("part-*.parquet"))}


def _checkpoint(spec, dataset) -> str:
    """A committed checkpoint of the spec's model, made in this process (no training job needed)."""
    import pyarrow as pa
    import torch

    from trnflow.workload.checkpoint import RunCheckpoints
    from trnflow.workload.programs import build_model
    from trnflow.workload.recipes import recipe_for

    texts = [json.loads(line)["text"] for line in (dataset / "inference" / "part-00000.jsonl").read_text().splitlines()]
    recipe = recipe_for(spec)
    recipe.fit(pa.table({spec.data.text_field: texts}))
    model = build_model(recipe, seed=5)
    rng = [{"torch": torch.get_rng_state(), "sr": torch.Generator().get_state()}]
    run = RunCheckpoints(f"{spec.train.checkpoint_url}/model")
    featurizer = (recipe.featurizer_file, recipe.state())
    return run.save(2, model.state_dict(), {"state": {}, "param_groups": []}, rng, featurizer,
                    checkpoint_meta("model", step=2))


def test_a_killed_inference_run_is_finished_by_a_rerun_without_touching_committed_shards(make_spec, backend, dataset):
    spec = make_spec(train={"steps": 2, "checkpoint_every": 2}, inference={"shard_size": 50})
    checkpoint = _checkpoint(spec, dataset)

    killed = make_spec(train={"steps": 2, "checkpoint_every": 2}, inference={"shard_size": 50},
                       faults=[{"kind": "kill", "core": 0, "step": 3}])  # rank 0, before its third shard
    first = _job(backend, killed, "infer", "model", checkpoint)
    assert first.state is JobState.FAILED and first.failure.retryable is True
    out = local_path(spec.inference.output_url)
    committed = {json.loads(m.read_text())["shard"] for m in (out / "_committed").glob("*.json")}
    assert {0, 2} <= committed and 4 not in committed and not (out / "_manifest.json").exists()
    before = {name: digest for name, digest in _checksums(out).items()
              if int(name.removeprefix("part-").removesuffix(".parquet")) in committed}

    rerun = _job(backend, spec, "infer", "model", checkpoint)
    assert rerun.state is JobState.SUCCEEDED, rerun.failure
    after = _checksums(out)
    assert all(after[name] == digest for name, digest in before.items())  # committed shards untouched
    assert rerun.result.shards_reused == len(committed) and len(after) == 7
    inputs = [json.loads(line)["id"] for line in (dataset / "inference" / "part-00000.jsonl").read_text().splitlines()]
    ids = pq.read_table(out).column("id").to_pylist()  # the folder reads as one table: bookkeeping is hidden
    assert sorted(ids) == sorted(inputs) and len(ids) == len(set(ids))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert {s["file"]: s["sha256"] for s in manifest["shards"]} == after and manifest["rows"] == len(inputs)

    # a torn shard (its file cut short after the commit) is found by its checksum and redone alone
    torn = out / "part-00003.parquet"
    torn.write_bytes(torn.read_bytes()[:100])
    again = _job(backend, spec, "infer", "model", checkpoint)
    assert again.state is JobState.SUCCEEDED, again.failure
    assert again.result.rows_embedded == 50 and again.result.shards_reused == 6
    assert _checksums(out) == after


def test_a_thousand_shard_plan_resumes_after_a_kill_and_publishes_each_shard_once(make_spec, backend, tmp_path):
    """At scale: 2,000 rows in 1,000 shards of 2, rank 0 killed before its 300th shard; the rerun
    reuses every committed shard and finishes the rest, the manifest names each shard once, and the
    pointer publishes them. (How its time grows with shards: benchmarks/scale_inference.py.)"""
    from trnflow.workload.embeddings import current_url, point_current, version_url
    from trnflow.workload.synth import synthesize

    data = tmp_path / "many"
    synthesize(data, days=1, rows_per_day=100, seed=11, holdout_rows=20, inference_rows=2000)
    sections = {"data": {"inference": str(data / "inference")}, "train": {"steps": 2, "checkpoint_every": 2},
                "inference": {"shard_size": 2, "output_url": version_url(str(tmp_path / "published"), 1)}}
    spec = make_spec(**sections)
    checkpoint = _checkpoint(spec, data)
    killed = _job(backend, make_spec(**sections, faults=[{"kind": "kill", "core": 0, "step": 300}]), "infer",
                  "model", checkpoint)
    assert killed.state is JobState.FAILED
    out = local_path(spec.inference.output_url)
    committed = {json.loads(m.read_text())["shard"] for m in (out / "_committed").glob("*.json")}
    assert set(range(0, 598, 2)) <= committed and 598 not in committed  # rank 0's first 299 shards, not its 300th
    before = {name: digest for name, digest in _checksums(out).items()
              if int(name.removeprefix("part-").removesuffix(".parquet")) in committed}

    rerun = _job(backend, spec, "infer", "model", checkpoint)
    assert rerun.state is JobState.SUCCEEDED, rerun.failure
    assert rerun.result.shards_reused == len(committed) and rerun.result.rows == 2000
    after = _checksums(out)
    assert len(after) == 1000 and all(after[name] == digest for name, digest in before.items())
    manifest = json.loads((out / "_manifest.json").read_text())
    assert [s["shard"] for s in manifest["shards"]] == list(range(1000))
    assert {s["file"]: s["sha256"] for s in manifest["shards"]} == after
    ids = pq.read_table(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == 2000
    pointer = point_current(str(tmp_path / "published"), "quickstart", 1)
    assert (pointer["folder"], pointer["shards"], pointer["rows"]) == ("v000001", 1000, 2000)
    assert local_path(current_url(str(tmp_path / "published"))) == out


def test_sampled_completions_resume_by_shard_and_equal_an_uninterrupted_runs(make_spec, backend, dataset, tmp_path):
    """hf-causal-lm with `inference.generate` (sampled, seeded), its prefill and decode programs
    compiled ahead (no graph compiled in inference): a run killed before its third shard and rerun
    writes, row for row, the completions of a run never killed, and of a run without the cache."""
    lm = {"recipe": "hf-causal-lm", "params": {"rows": "text", "seq_len": 32, "vocab_size": 300, "config": {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1}}}
    sections = {"model": lm, "gate": {"metric": "perplexity", "metrics": []},
                "train": {"steps": 2, "checkpoint_every": 2}}
    generate = {"max_new_tokens": 4, "temperature": 1.0, "top_k": 20, "seed": 9}

    def spec(out: str, kv_cache: bool = True, **more):
        return make_spec(1, inference={"shard_size": 50, "batch_size": 16, "output_url": str(tmp_path / out),
                                       "generate": {**generate, "kv_cache": kv_cache}},
                         compile={"cache_url": str(tmp_path / "cache"), "optlevel": 1, "fail_on_recompile": kv_cache},
                         **sections, **more)

    checkpoint = _checkpoint(spec("whole"), dataset)
    compiled = _job(backend, spec("whole"), "compile", "programs")
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    assert {"prefill_step", "decode_step"} <= {p.program for p in compiled.result.programs}
    whole = _job(backend, spec("whole"), "infer", "model", checkpoint)
    assert whole.state is JobState.SUCCEEDED, whole.failure
    assert whole.result.compile.recompiles == [] and whole.result.compile.hits >= 2
    killed = _job(backend, spec("resumed", faults=[{"kind": "kill", "core": 0, "step": 3}]), "infer", "model",
                  checkpoint)
    assert killed.state is JobState.FAILED and killed.failure.retryable is True
    rerun = _job(backend, spec("resumed"), "infer", "model", checkpoint)
    assert rerun.state is JobState.SUCCEEDED, rerun.failure
    assert rerun.result.shards_reused == 2

    def completions(out: str) -> dict:
        table = pq.read_table(tmp_path / out)
        return dict(zip(table.column("id").to_pylist(), zip(table.column("completion").to_pylist(),
                                                               table.column("completion_tokens").to_pylist(),
                                                               strict=True), strict=True))

    ours, theirs = completions("resumed"), completions("whole")
    assert ours == theirs and len(ours) == 350 and all(0 < n <= 4 for _, n in ours.values())
    assert len({text for text, _ in ours.values()}) > 10  # sampled: not one completion for every row
    recomputed = _job(backend, spec("recomputed", kv_cache=False), "infer", "model", checkpoint)
    assert recomputed.state is JobState.SUCCEEDED, recomputed.failure
    assert completions("recomputed") == theirs  # the same draws from the same probabilities
