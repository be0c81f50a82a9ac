"""The `xla` device on torch-xla's CPU runtime (or the device TRNFLOW_LANE_DEVICE names on a Neuron
host): the same workload as on the emulator, the same numbers, checkpoints that cross between the
two, a flat graph count and a recompile guard that holds.

Training runs call the workload itself (`python -m trnflow.workload train`), as every backend
does, with the spec's `compute.device` the only difference between the two devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.sdk_tools import fake_parallel_compile
from tests.xla.conftest import DEVICE, INSTANCE, trnflow, write_spec
from trnflow.workload import checkpoint

LOSS_RTOL = 1e-4


def train(folder: Path, device: str, steps: int, run_id: str = "lane", **sections) -> tuple[int, dict]:
    """Train `steps` steps of the lane's spec on `device` in `folder` (resuming its checkpoints):
    the exit code, and the result (or the failure)."""
    spec = write_spec(folder, compute={"device": device},
                      train={"steps": steps, "log_every": 1, "checkpoint_every": 10, **sections.pop("train", {})},
                      gate={"eval_every": 1000}, **sections)  # evaluated at the end only
    out = folder / f"out-{device}-{steps}"
    env = {k: v for k, v in os.environ.items() if k != "TRNFLOW_DEVICE"}
    done = subprocess.run([sys.executable, "-m", "trnflow.workload", "train", "--spec", str(spec), "--output",
                           str(out), "--run-id", run_id], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=900)
    found = out / ("result.json" if done.returncode == 0 else "failure-rank0.json")
    assert found.exists(), f"train on {device} wrote no {found.name}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(found.read_text())


def losses(result: dict) -> list[float]:
    return [p["loss"] for p in result["curve"]]


def relative(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# The lane's two workers take the tests in file order (`--dist worksteal`): the first half go to one,
# the other half to the other, and a worker done early takes work from the other's end. So the order
# balances the two: the pipeline (the longest), the recompile guard, the weights' round trip and the
# external recipe, against the fine-tuning example, the checkpoints across devices, the parallel
# compile and the first losses.
def test_the_pipeline_runs_end_to_end(workdir, lane):
    """The lane's spec file through all six stages on the lane's device, 40 steps instead of 120,
    gated against the reference run of the same spec on the emulator: the device's accuracy must
    match the emulator's within the gate's 0.1 points at every evaluation."""
    spec, device = str(Path(__file__).with_name("one-core.yaml")), DEVICE
    sets = ["--set", f"compute.instance_type={INSTANCE}", "--set", "train.steps=40",
            "--set", "train.checkpoint_every=20", "--set", "gate.eval_every=20"]
    if INSTANCE == "trn1.2xlarge":  # the file as it is (validate takes no --set)
        trnflow("validate", spec, cwd=workdir)
    trnflow("reference", spec, *sets, "--set", "compute.device=emulator", cwd=workdir)
    done = trnflow("run", spec, *sets, "--set", f"compute.device={device}", "--json", cwd=workdir)
    outcome = json.loads(done.stdout)
    assert outcome["state"] == "Completed", outcome
    states = {row["stage"]: row["state"] for row in outcome["stages"]}
    assert states == dict.fromkeys(("sanity", "collectives", "compile", "train", "evaluate", "infer", "promote"),
                                   "Completed"), states
    ran_on = {stage: r["device"]["name"] for stage, r in outcome["results"].items() if r.get("device")}
    assert set(ran_on.values()) == {device} and "train" in ran_on, ran_on
    results = outcome["results"]
    assert results["evaluate"]["verdict"]["passed"] is True, results["evaluate"]
    jobs = [json.loads(f.read_text()) for f in (workdir / ".trnflow" / "jobs").glob("*-train-*/output/result.json")]
    assert sorted(j["device"]["name"] for j in jobs) == sorted(["emulator", device]), jobs  # the reference's, the run's
    trained = results["train"]["compile"]  # every graph training met was compiled ahead of time
    assert trained["recompiles"] == [] and trained["hits"] == trained["graphs"] > 0, trained
    shards = sorted((workdir / "embeddings").rglob("*.parquet"))
    assert shards, "no embeddings were written"
    lane[f"pipeline on {device}"] = (f"six stages completed, gate passed against the emulator's reference, "
                                     f"training met {trained['graphs']} graphs "
                                     f"all from the compile cache, {len(shards)} embedding shards")


def test_a_new_input_shape_mid_run_trips_the_recompile_guard(workdir, lane):
    """With the last partial batch kept (120 rows, 32 a batch), step 4 has 24 rows: a graph the
    ahead-of-time compile never saw, which compile.max_recompiles: 0 refuses, naming its shape."""
    day = sorted((workdir / "data" / "train").iterdir())[0]
    short = workdir / "short" / day.name
    short.mkdir(parents=True)
    rows = (day / "part-00000.jsonl").read_text().splitlines(keepends=True)
    (short / "part-00000.jsonl").write_text("".join(rows[:120]))
    data = {"train": "short"}
    spec = write_spec(workdir, train={"drop_last": False}, data=data)
    report = json.loads(trnflow("compile", str(spec), "--json", cwd=workdir).stdout)
    assert report["graphs"] >= 3 and report["compiled"] == report["graphs"], report
    assert {row["program"] for row in report["programs"]} == {"train_step", "eval_step", "embed_step"}, report
    # training's first steps trace graphs of their own; one run of each program compiled all of its graphs
    graphs = Counter(row["program"] for row in report["report"].values())
    assert {row["program"]: row["together"] for row in report["report"].values()} == graphs, report
    assert graphs["train_step"] > 1, report
    checked = json.loads(trnflow("compile", str(spec), "--check", "--json", cwd=workdir).stdout)
    assert checked["misses"] == 0, checked

    code, failure = train(workdir, DEVICE, 10, compile={"max_recompiles": 0}, train={"drop_last": False}, data=data)
    assert code != 0, failure
    message = json.dumps(failure)
    assert "over compile.max_recompiles (0)" in message and "[24, 32] int64" in message, message
    lane["recompile guard"] = "step 4's 24-row batch was refused as recompilation 1 over max_recompiles 0"


def test_weights_make_the_round_trip_through_the_device_bit_for_bit(workdir):
    """The device's host copies (what checkpoints are saved from) are the weights put there, bit for bit."""
    from trnflow.device.registry import get_device

    code, result = train(workdir, "emulator", 10)
    assert code == 0
    saved = checkpoint.load(result["checkpoint"])
    device = get_device(DEVICE)
    back = device.to_host({k: device.put(v) for k, v in saved.model.items()})
    assert all(torch.equal(back[k], v) for k, v in saved.model.items())


def _example_on_the_device(workdir: Path, example: str, recipe: str, data: str, steps: int, global_batch_size: int,
                           precision: str | None = None, pretrained: str | None = None) -> tuple[dict, dict]:
    """An example spec file of the project (`example`, from its root) on the lane's device, one core,
    its data under `workdir/<data>`, through the six stages with `trnflow run`: every stage completed,
    trained by `recipe` on the device, every graph from the compile cache. The results, and the
    training's compile figures."""
    import yaml

    spec = yaml.safe_load((Path(__file__).parents[2] / example).read_text())
    if pretrained:
        spec["model"]["params"]["pretrained"] = pretrained
    spec["data"].update({part: f"{data}/{part}" for part in ("train", "holdout", "inference")})
    spec["compute"].update(device=DEVICE, instance_type=INSTANCE, cores_per_node=1,
                           **({"precision": precision} if precision else {}))
    spec["train"].update(steps=steps, checkpoint_every=steps, global_batch_size=global_batch_size)
    spec["gate"].update(reference="champion", eval_every=None)
    path = workdir / Path(example).name
    path.write_text(yaml.safe_dump(spec))
    outcome = json.loads(trnflow("run", str(path), "--json", cwd=workdir).stdout)
    assert outcome["state"] == "Completed", outcome
    results = outcome["results"]
    assert results["train"]["device"]["name"] == DEVICE and results["train"]["recipe"]["recipe"] == recipe
    trained = results["train"]["compile"]
    assert trained["recompiles"] == [] and trained["hits"] == trained["graphs"] > 0, trained
    return results, trained


def test_an_external_recipe_runs_the_pipeline_on_the_device(workdir, lane):
    """The example recipe tabular-mlp (examples/recipes, installed in the lane's venv): its spec file
    on the lane's device, one core, through the six stages; it publishes predictions."""
    import numpy as np
    import pyarrow.parquet as pq
    from tabular_recipe.data import rows

    rng = np.random.default_rng(5)
    for name, n, labelled in (("train/dt=2026-01-01", 600, True), ("holdout", 300, True), ("inference", 200, False)):
        (workdir / "tabular" / name).mkdir(parents=True)
        pq.write_table(rows(rng, n, 0, labelled), workdir / "tabular" / name / "part-00000.parquet")
    results, trained = _example_on_the_device(workdir, "examples/recipes/tabular.yaml", "tabular-mlp", "tabular",
                                              steps=30, global_batch_size=32)
    assert results["infer"]["published"] == "predictions" and results["infer"]["rows"] == 200
    lane["external recipe"] = (f"tabular-mlp ran six stages on {DEVICE}: {trained['graphs']} graphs, all from the "
                               f"compile cache; {results['infer']['rows']} predictions published")


def test_fine_tuning_a_pretrained_language_model_runs_the_pipeline_on_the_device(workdir, lane):
    """The fine-tuning example (jobspecs/examples/causal-lm.yaml) on the lane's device, one core: a
    tiny pretrained decoder and its own tokenizer, prompt/completion rows, gated on perplexity, every
    graph from the compile cache."""
    from tests.pretrained import tiny_causal_lm
    from trnflow.workload.synth import synthesize

    synthesize(workdir / "prompts", days=1, rows_per_day=200, seed=5, fmt="prompt-completion", holdout_rows=48,
               inference_rows=40)
    texts = [json.loads(line)[k] for line in (workdir / "prompts/train/dt=2026-01-01/part-00000.jsonl")
             .read_text().splitlines() for k in ("prompt", "completion")]
    folder = tiny_causal_lm(workdir / "decoder", texts)
    results, trained = _example_on_the_device(workdir, "jobspecs/examples/causal-lm.yaml", "hf-causal-lm", "prompts",
                                              steps=20, global_batch_size=16, precision="fp32", pretrained=str(folder))
    point = results["evaluate"]["points"][-1]
    assert results["evaluate"]["verdict"]["metric"] == "perplexity" and point["perplexity"] > 1
    assert results["infer"]["rows"] == 40
    lane["fine-tuning"] = (f"hf-causal-lm ran six stages on {DEVICE}: holdout perplexity {point['perplexity']:.3f}, "
                           f"{trained['graphs']} graphs, all from the compile cache")


def test_lora_adapters_on_chats_run_the_pipeline_on_the_device(workdir, lane):
    """The LoRA example (jobspecs/examples/causal-lm-lora.yaml) on the lane's device, one core: adapters
    on a tiny pretrained decoder's frozen weights, trained on chats, gated on perplexity, each chat's
    last turn generated in inference; every graph from the compile cache."""
    from tests.pretrained import tiny_causal_lm
    from trnflow.workload.synth import synthesize

    synthesize(workdir / "chats", days=1, rows_per_day=200, seed=5, fmt="chat", holdout_rows=48, inference_rows=40)
    texts = [turn["content"] for line in (workdir / "chats/train/dt=2026-01-01/part-00000.jsonl").read_text()
             .splitlines() for turn in json.loads(line)["messages"]]
    folder = tiny_causal_lm(workdir / "chat-decoder", texts)
    results, trained = _example_on_the_device(workdir, "jobspecs/examples/causal-lm-lora.yaml", "hf-causal-lm",
                                              "chats", steps=20, global_batch_size=16, precision="fp32",
                                              pretrained=str(folder))
    point = results["evaluate"]["points"][-1]
    assert results["evaluate"]["verdict"]["metric"] == "perplexity" and point["perplexity"] > 1
    assert results["infer"]["rows"] == 40 and results["infer"]["compile"]["recompiles"] == []
    lane["lora"] = (f"LoRA adapters ran six stages on {DEVICE}: holdout perplexity {point['perplexity']:.3f}, "
                    f"{trained['graphs']} training graphs, all from the compile cache; 40 completions generated")


def test_a_checkpoint_moves_between_xla_and_the_emulator(workdir, lane):
    """xla trains steps 1-10, the emulator resumes its checkpoint for steps 11-20, xla resumes that
    for 21-30. Each resumed run holds, on its device, exactly the weights the other one saved, and
    the losses are those of 30 steps on the emulator alone."""
    crossed, alone = workdir / "crossed", workdir / "alone"
    for folder in (crossed, alone):
        folder.mkdir()
        (folder / "data").symlink_to(workdir / "data")
    curve: list[float] = []
    for device, steps, first in ((DEVICE, 10, 0), ("emulator", 20, 10), (DEVICE, 30, 20)):
        code, result = train(crossed, device, steps)
        assert code == 0 and result["start_step"] == first and result["device"]["name"] == device, result
        if first:
            saved = checkpoint.load(result["resumed_from"])
            assert saved.meta.global_step == first
            assert result["resumed_weights"] == checkpoint.weights_digest(saved.model), f"resumed on {device}"
        curve += losses(result)[-10:]
    code, reference = train(alone, "emulator", 30)
    assert code == 0
    worst = relative(curve, losses(reference))
    assert worst <= LOSS_RTOL, (curve, losses(reference))
    lane["checkpoints across devices"] = (f"{DEVICE} -> emulator -> {DEVICE}: each resumed with the saved weights "
                                          f"bit for bit; losses within {worst:.2e} of 30 steps on the emulator alone")


def test_the_trial_runs_under_neuron_parallel_compile_where_it_is_on_path(workdir, lane):
    """Where the SDK's neuron_parallel_compile is on PATH (here, an executable that acts as it does),
    the compile stage runs the trial under it first, with the cache in NEURON_CC_FLAGS, then records
    each graph; a failed compilation fails the stage with the tool's words."""
    if DEVICE != "xla":
        pytest.skip("neuron_parallel_compile serves the xla device; native TorchNeuron compiles through torch.compile")
    record, tools = workdir / "parallel-compile.json", workdir / "bin"
    fake_parallel_compile(tools, record)
    spec = write_spec(workdir, compile={"workers": 3})
    env = {"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    report = json.loads(trnflow("compile", str(spec), "--json", cwd=workdir, env=env).stdout)
    seen = json.loads(record.read_text())
    assert seen["workers"] == 3 and seen["command"][1:4] == ["-m", "trnflow.workload", "compile"], seen
    assert seen["trial_exit"] == 0 and seen["trial_result"]["trial"] is True, seen
    assert f"--cache_dir={workdir / 'compile-cache'} " in f"{seen['neuron_cc_flags']} ", seen  # a path, not a URL
    assert report["parallel_compile"] == {"tool": "neuron_parallel_compile", "workers": 3, "graphs": 3,
                                          "compiled": 3, "failed": 0}, report
    assert report["graphs"] >= 3 and report["compiled"] == report["graphs"], report

    fake_parallel_compile(tools, record, failed=1, trial=False)  # its words on failing: no second trial
    failed = trnflow("compile", str(write_spec(workdir, compile={"workers": 3, "cache_url": str(workdir / "c2")})),
                     cwd=workdir, env=env, check=False)
    said = failed.stdout + failed.stderr
    assert failed.returncode != 0 and "neuron_parallel_compile failed (exit 1, 1 failed compilations)" in said, said
    lane["parallel compile"] = "the trial ran under neuron_parallel_compile --num_parallel 3 with the cache in " \
        "NEURON_CC_FLAGS; a failed compilation failed the stage"


def test_the_first_losses_match_the_emulators_and_the_graph_count_stays_flat(workdir, lane):
    for sub in ("emulator", DEVICE):
        (workdir / sub).mkdir()
        (workdir / sub / "data").symlink_to(workdir / "data")
    code, on_emulator = train(workdir / "emulator", "emulator", 20)
    assert code == 0
    code, on_xla = train(workdir / DEVICE, DEVICE, 20)
    assert code == 0
    assert on_xla["device"]["name"] == DEVICE and on_emulator["device"]["name"] == "emulator"
    worst = relative(losses(on_xla), losses(on_emulator))
    assert worst <= LOSS_RTOL, (losses(on_xla), losses(on_emulator))
    lane["fp32 losses, steps 1-20"] = f"max relative difference from the emulator {worst:.2e} (limit {LOSS_RTOL:.0e})"

    graphs = [p["graphs"] for p in on_xla["curve"]]
    warm = graphs[1]  # a step's graphs are all known after two steps: the optimizer's state exists from step 2
    assert warm > 0 and graphs[2:] == [warm] * (len(graphs) - 2), graphs
    assert on_xla["compile"]["graphs"] == warm + 1  # and the final evaluation's
    lane["graphs compiled"] = f"{graphs[0]} after step 1, {warm} after step 2, {graphs[-1]} after step 20 (flat)"
