"""hf-causal-lm through the six stages: fine-tuned from a pretrained decoder and its own tokenizer on
prompt/completion rows packed into windows (data.packing) with three seeds on the emulator, every
program compiled ahead, each ending well below the starting model's perplexity; a chat full
fine-tune whose every job after the compile stage runs no program it did not build; and the
fine-tuning example (unpacked) on the mock SageMaker. The example as `make
causal-lm` runs it, gate, scores and export, is test_make_targets.py's."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.json as pajson
import pytest
import torch

from tests.pretrained import tiny_causal_lm
from trnflow.flows.pipeline import STAGES, pipeline
from trnflow.lifecycle.registry import Registry
from trnflow.workload.recipes import recipe_for
from trnflow.workload.synth import synthesize

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prompts")
    synthesize(root, days=1, rows_per_day=320, seed=5, fmt="prompt-completion", holdout_rows=96, inference_rows=50)
    return root


def _rows(folder: Path) -> pa.Table:
    return pa.concat_tables([pajson.read_json(f) for f in sorted(folder.rglob("*.jsonl"))])


EXAMPLE = Path(__file__).parents[2] / "jobspecs" / "examples" / "causal-lm.yaml"


def _example(folder: Path, prompts: Path, out: Path, **changes) -> dict:
    """The fine-tuning example's spec, with its pretrained folder, data and outputs moved."""
    import yaml

    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["params"]["pretrained"] = str(folder)
    data["data"].update({part: str(prompts / part) for part in ("train", "holdout", "inference")})
    data["compile"]["cache_url"] = str(out / "lm-cache")
    data["train"]["checkpoint_url"] = str(out / "checkpoints")
    data["gate"]["reference"] = str(out / "reference" / "metrics.json")
    data["registry_url"] = str(out / "registry")
    data["inference"]["output_url"] = str(out / "scores")
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    return data


def _six_stages(spec) -> dict:
    """The pipeline run on `spec`, every stage completed: its results."""
    state = pipeline(spec, return_state=True)
    outcome = state.result(raise_on_failure=False).model_dump(mode="json")
    assert state.is_completed(), outcome
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
    return outcome["results"]


def test_fine_tuning_lowers_holdout_perplexity_from_the_starting_models_on_three_seeds(make_spec, tmp_path,
                                                                                     prompts, trnflow_home):
    """The training stage alone, its rows packed, compiled once (no graph compiled in training),
    then run with three seeds: each ends with a holdout perplexity well below the pretrained model's."""
    from trnflow.backends import JobRequest, JobState, wait
    from trnflow.backends.local import LocalBackend
    from trnflow.settings import TrnflowSettings

    train = _rows(prompts / "train")
    folder = tiny_causal_lm(tmp_path / "pretrained", train.column("prompt").to_pylist()
                            + train.column("completion").to_pylist())
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    spec = make_spec(
        1, model={"recipe": "hf-causal-lm", "params": {"pretrained": str(folder), "seq_len": 128}},
        data={"train": str(prompts / "train"), "holdout": str(prompts / "holdout"),
              "inference": str(prompts / "inference"), "packing": True},
        compile={"cache_url": str(tmp_path / "lm-cache"), "optlevel": 1, "fail_on_recompile": True},
        train={"steps": 30, "checkpoint_every": 30, "lr": 0.003, "global_batch_size": 16},  # one rank, 16 a step
        gate={"metric": "perplexity", "metrics": [], "reference": None, "eval_every": None})
    compiled = wait(backend, backend.submit(JobRequest(spec, "compile", "seeds", processes=1)), 0.2)
    assert compiled.state is JobState.SUCCEEDED, compiled.failure
    recipe = recipe_for(spec)
    recipe.fit(train)  # the folder's own tokenizer: the same for every seed
    holdout = recipe.features(_rows(prompts / "holdout"))
    with torch.no_grad():
        start = recipe.evaluate(recipe.build_model().eval()(holdout).double(), torch.zeros(len(holdout)), [])
    tuned = {}
    for seed in (1, 2, 3):
        seeded = spec.model_copy(update={"train": spec.train.model_copy(update={
            "seed": seed, "checkpoint_url": str(tmp_path / f"checkpoints-{seed}")})})
        job = wait(backend, backend.submit(JobRequest(seeded, "train", f"seed-{seed}")), 0.2)
        assert job.state is JobState.SUCCEEDED, job.failure
        packing = job.result.packing  # the 320 rows of about 44 tokens, two or three to a window of 128
        assert job.result.rows == packing.rows == 320 and packing.windows < 180 and packing.fill > 0.6
        tuned[seed] = job.result.evaluations[-1].value("perplexity")
    assert len(set(tuned.values())) == 3, tuned  # three different runs
    assert all(p < 0.8 * start["perplexity"] for p in tuned.values()), (start, tuned)


def test_a_chat_full_fine_tune_runs_only_programs_the_compile_stage_built(make_spec, tmp_path, trnflow_home):
    """Chats, every weight trained and evaluated during training, then inference generating each
    chat's last turn through the cache: compiled once by the compile stage, and every job after it
    with `fail_on_recompile`, so a program it missed would fail that job, its shapes named. On two
    cores, with a decoder over DDP's first gradient bucket (1 MB of weights), whose graph TorchDynamo
    would otherwise split at the bucket's end into graphs the stage's trial never met."""
    import json

    import pyarrow.parquet as pq

    from trnflow.backends import JobRequest, JobState, wait
    from trnflow.backends.local import LocalBackend
    from trnflow.settings import TrnflowSettings

    chats = tmp_path / "chats"
    synthesize(chats, days=1, rows_per_day=160, seed=5, fmt="chat", holdout_rows=32, inference_rows=24)
    texts = [turn["content"] for line in (chats / "train/dt=2026-01-01/part-00000.jsonl").read_text().splitlines()
             for turn in json.loads(line)["messages"]]
    folder = tiny_causal_lm(tmp_path / "decoder", texts, hidden_size=128)  # 1.4 MB of fp32 weights
    spec = make_spec(
        2, model={"recipe": "hf-causal-lm", "params": {"pretrained": str(folder), "seq_len": 112, "rows": "chat"}},
        data={part: str(chats / part) for part in ("train", "holdout", "inference")},
        compile={"cache_url": str(tmp_path / "chat-cache"), "optlevel": 1, "fail_on_recompile": True},
        train={"steps": 6, "checkpoint_every": 6, "log_every": 3, "lr": 0.003, "global_batch_size": 16},
        gate={"metric": "perplexity", "metrics": [], "reference": None, "eval_every": 3},
        inference={"output_url": str(tmp_path / "scores"), "batch_size": 16, "shard_size": 24,
                   "generate": {"max_new_tokens": 6}})
    backend = LocalBackend(TrnflowSettings().jobs_dir)

    def job(phase: str, checkpoint: str | None = None):
        done = wait(backend, backend.submit(JobRequest(spec, phase, "chat", checkpoint=checkpoint)), 0.2)
        assert done.state is JobState.SUCCEEDED, done.failure
        return done.result

    compiled = job("compile")
    assert {plan.program for plan in compiled.programs} == {"train_step", "eval_step", "embed_step", "prefill_step",
                                                            "decode_step"}
    trained = job("train")
    assert [e.step for e in trained.evaluations] == [3, 6] and trained.compile.recompiles == []
    inferred = job("infer", trained.checkpoint)
    assert inferred.rows == 24 and inferred.compile.recompiles == [] and inferred.compile.hits >= 3
    completions = pq.read_table(tmp_path / "scores", columns=["completion_tokens"]).column("completion_tokens")
    assert all(0 < n <= 6 for n in completions.to_pylist())


def test_the_example_runs_on_the_mock_sagemaker(prefect_api, moto_endpoint, tmp_path, monkeypatch, prompts):
    """jobspecs/examples/causal-lm.yaml on SageMaker (the mock cloud), its data and outputs on S3, its
    pretrained folder local to the containers: six stages, gated on perplexity."""
    import yaml

    from tests.clouds import in_cloud
    from trnflow.specs import validate_spec

    train = _rows(prompts / "train")
    folder = tiny_causal_lm(tmp_path / "pretrained", train.column("prompt").to_pylist()
                            + train.column("completion").to_pylist())
    data = yaml.safe_load((Path(__file__).parents[2] / "jobspecs" / "examples" / "causal-lm.yaml").read_text())
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, prompts, in_process=True) as (_, bucket):
        s3 = f"s3://{bucket}"
        data["model"]["params"]["pretrained"] = str(folder)
        data["data"].update({part: f"{s3}/reviews/{part}" for part in ("train", "holdout", "inference")})
        data["compute"].update(backend="sagemaker", cores_per_node=1)  # the example's two ranks: the make target's
        data["compile"].update(cache_url=f"{s3}/lm-cache", optlevel=1)  # the default optlevel: the first test's
        data["train"].update(steps=20, checkpoint_every=20, global_batch_size=16, checkpoint_url=f"{s3}/checkpoints")
        data["gate"].update(reference="champion", eval_every=None)
        data.update(registry_url=f"{s3}/registry", inference={**data["inference"], "output_url": f"{s3}/scores"})
        spec = validate_spec(data)
        results = _six_stages(spec)
        assert results["train"]["recipe"]["recipe"] == "hf-causal-lm"
        assert results["evaluate"]["verdict"]["metric"] == "perplexity"
        assert results["infer"]["rows"] == 50 and Registry(spec.registry_url).champion(spec.name).entry.export
