"""Tensor parallelism (`train.parallelism.tp`): its speed against a bare DTensor loop, the weights
each core holds, and the losses at tp 1, 2 and 4.

- Speed: trnflow's training stage with a Llama-style decoder's layers split over `--ranks` cores
  against a bare PyTorch tensor-parallel loop of the same model, batch and cores (`_bare_tp.py`:
  `parallelize_module` with ColwiseParallel and RowwiseParallel, one thread per rank pinned to a CPU
  of its own, as trnflow's workers are with `compute.threads_per_core: 1`), repeats interleaved.
  Each reports its median step after the graphs are loaded. Goal: at least 0.95x the bare loop's
  samples/s by the paired median.
- Memory: the weight bytes a core holds at tp 2 and 4, less the layers that stay whole, over the
  split layers' bytes. Goal: 1/2 and 1/4, within 5%.
- Losses: the first 50 steps' losses at tp 1, 2 and 4 (one replica each: 1, 2 and 4 cores, the same
  batches), at lr 3e-4. Goal: equal within 1e-5. (A split layer sums its parts in another order, so
  the weights differ in their last bits; at the quickstart's lr of 2e-3 training amplifies that to
  1e-4 by step 40 and 1e-3 by step 45, at 3e-4 it stays within 1e-6.)

    python benchmarks/tensor_parallel.py [--steps 60] [--ranks 2] [--repeats 4]

The last line printed is JSON (`_report`'s shape).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import difference_figure, emit, limit_figure, ratio_figure
from _torchrun import torchrun_json

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings

MODEL = {"recipe": "hf-causal-lm", "params": {
    "model_type": "llama", "vocab_size": 512, "seq_len": 32, "rows": "text",
    "config": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 8,
               "num_key_value_heads": 8}}}
LOSS_STEPS = 50


def _spec(root: Path, cores: int, tp: int, steps: int, log_every: int = 10):
    return quickstart(root, model=MODEL,
                      compute={"cores_per_node": cores, "instance_type": "trn1.32xlarge", "precision": "fp32",
                               "threads_per_core": 1},
                      compile={"cache_url": str(root / "cache"), "optlevel": 1},
                      train={"steps": steps, "checkpoint_every": steps, "log_every": log_every, "global_batch_size": 8,
                             "lr": 0.0003,
                             "parallelism": {"strategy": "ddp", "tp": tp}},
                      gate={"reference": None, "metric": "perplexity", "metrics": [], "eval_every": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        curves, weights = {}, {}
        for tp in (1, 2, 4):  # one replica each: the whole batch's loss at every step
            result = run_job(backend, _spec(root, tp, tp, LOSS_STEPS, log_every=1), "train", f"losses-tp{tp}")
            curves[tp] = [point["loss"] for point in result["curve"]]
            weights[tp] = result["device_memory"]["weights"]
        from trnflow.workload.programs import build_model  # torch: after the jobs' own imports have warmed up
        from trnflow.workload.recipes import recipe_for

        recipe = recipe_for(_spec(root, 2, 2, 4))
        split = recipe.tensor_plan(build_model(recipe, 0), 1).split_parameters()[0] * 4  # fp32 bytes
        share = {tp: (weights[tp] - (weights[1] - split)) / split for tp in (2, 4)}
        spec = _spec(root, args.ranks, args.ranks, args.steps)
        spec_file = root / "spec.json"
        spec_file.write_text(spec.model_dump_json())
        run_job(backend, spec, "train", "warm-up")  # the train program into the cache once
        times: dict[str, list[float]] = {"trnflow": [], "bare": []}
        for i in range(args.repeats):
            for what in (("trnflow", "bare") if i % 2 == 0 else ("bare", "trnflow")):
                if what == "bare":
                    step = torchrun_json("_bare_tp.py", args.ranks, spec_file, args.steps)
                else:
                    step = run_job(backend, spec, "train", f"run-{i}")
                times[what].append(step["median_step_seconds"])
            print(f"repeat {i + 1}: step ms trnflow {times['trnflow'][-1] * 1000:.2f}, bare "
                  f"{times['bare'][-1] * 1000:.2f}", flush=True)
    batch = spec.train.global_batch_size
    rate = {w: [batch / s for s in v] for w, v in times.items()}
    gaps = {tp: max(abs(a - b) for a, b in zip(curves[tp], curves[1], strict=True)) for tp in (2, 4)}
    print(f"tp {args.ranks}: trnflow {batch / statistics.median(times['trnflow']):.1f} samples/s, bare DTensor loop "
          f"{batch / statistics.median(times['bare']):.1f} (medians of {args.repeats}); split layers per core: "
          + ", ".join(f"tp {tp} {s:.3f}" for tp, s in share.items())
          + f"; largest loss gap over {LOSS_STEPS} steps: " + ", ".join(f"tp {tp} {g:.2e}" for tp, g in gaps.items()))
    figures = [
        ratio_figure(f"tp {args.ranks} training samples/s", rate["trnflow"], rate["bare"], unit="samples/s",
                     baseline_name="bare DTensor loop", goal=0.95),
        *(difference_figure(f"split layers' weights per core at tp {tp}, over 1/{tp}", [s * tp], [1.0], unit="x",
                            baseline_name=f"1/{tp}", goal=0.05) for tp, s in share.items()),
        *(limit_figure(f"largest loss difference, tp {tp} against tp 1", [g], 1e-5, unit="loss")
          for tp, g in gaps.items()),
    ]
    emit("tensor_parallel", figures, ranks=args.ranks, steps=args.steps, step_seconds=times,
         weight_bytes_per_core={str(tp): b for tp, b in weights.items()}, split_layer_bytes=split,
         losses={str(tp): c for tp, c in curves.items()})


if __name__ == "__main__":
    main()
