"""Activation checkpointing on a Llama-style decoder: memory per rank and step time with each
`train.activation_checkpointing` setting, the losses alike.

The decoder (hidden 384, 4 layers, 6 heads, a 2,048-token vocabulary, rows of 96 tokens) trains from
scratch on review text on `--ranks` ranks, `--steps` steps at a global batch of 16, in fp32, once
with each setting: `none` (every activation saved for the backward pass), `selective` (the matrix
products' and attention's outputs kept, the rest recomputed) and `full` (each block's input kept,
the block recomputed). Compared, against `none` in the same run:

- memory per rank (weights, gradients, optimizer state and saved activations, as the training job
  measures them on its first step): goal at most 0.6x with full recomputation;
- step time (each run's median step after its graphs are loaded): what the memory costs;
- the final loss: goal equal (recomputation replays the same operations).

    python benchmarks/lm.py [--steps 20] [--ranks 2]

The last line printed is JSON (`_report`'s shape).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import difference_figure, emit, ratio_figure

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings

DECODER = {"model_type": "llama", "vocab_size": 2048, "seq_len": 96, "rows": "text",
           "config": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
                      "num_key_value_heads": 6, "tie_word_embeddings": True}}
SETTINGS = ("none", "selective", "full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        for setting in SETTINGS:
            spec = quickstart(root, name=f"lm-{setting}", model={"recipe": "hf-causal-lm", "params": DECODER},
                              compute={"cores_per_node": args.ranks, "precision": "fp32", "threads_per_core": 1},
                              compile={"cache_url": str(root / "cache")},
                              train={"steps": args.steps, "global_batch_size": 16, "lr": 0.003, "seed": 3,
                                     "checkpoint_every": args.steps, "log_every": args.steps,
                                     "activation_checkpointing": setting,
                                     "checkpoint_url": str(root / "checkpoints" / setting)},
                              gate={"reference": None, "metric": "perplexity", "metrics": []})
            results[setting] = run_job(backend, spec, "train", f"lm-{setting}")
            held, ran = results[setting]["device_memory"], results[setting]
            print(f"{setting}: memory per rank {held['total'] / 2**20:.1f} MiB (saved activations "
                  f"{held['activations'] / 2**20:.1f} MiB), step {ran['median_step_seconds'] * 1000:.1f} ms, "
                  f"loss {ran['loss']:.6f}", flush=True)
    memory = {s: r["device_memory"] for s, r in results.items()}
    step = {s: r["median_step_seconds"] for s, r in results.items()}
    loss = {s: r["loss"] for s, r in results.items()}
    figures = [
        ratio_figure("memory per rank, full recomputation over none", [memory["full"]["total"]],
                     [memory["none"]["total"]], unit="bytes", baseline_name="no recomputation", better="lower",
                     goal=0.6),
        ratio_figure("memory per rank, selective recomputation over none", [memory["selective"]["total"]],
                     [memory["none"]["total"]], unit="bytes", baseline_name="no recomputation", better="lower"),
        ratio_figure("step time, full recomputation over none", [step["full"]], [step["none"]], unit="s",
                     baseline_name="no recomputation", better="lower"),
        ratio_figure("step time, selective recomputation over none", [step["selective"]], [step["none"]], unit="s",
                     baseline_name="no recomputation", better="lower"),
        difference_figure("final loss, full recomputation against none", [loss["full"]], [loss["none"]], unit="loss",
                          baseline_name="no recomputation", goal=1e-6),
    ]
    emit("lm", figures, ranks=args.ranks, steps=args.steps, memory_per_rank=memory, step_seconds=step, loss=loss)


if __name__ == "__main__":
    main()
