"""LoRA adapters against full fine-tuning of the same pretrained model, batch and ranks, in one run.

A Llama-style decoder (hidden 384, 4 layers, 2,048 tokens) is first trained by trnflow on review
text and exported: the pretrained model. It is then fine-tuned on chats (`trnflow data synth
--format chat`), once with every weight training and once with LoRA adapters (r 4 on every linear
layer of the attention and the MLP), the two interleaved `--repeats` times, and compared on:

- the share of parameters that train;
- step time (each run's median step after its graphs are loaded): goal at most 0.8x full's;
- memory per rank (weights, gradients, optimizer state and saved activations, as the training job
  measures them): goal at most 0.6x full's;
- checkpoint bytes (every file of the last checkpoint): goal at most 2% of full's;
- holdout perplexity after the same steps: goal within 5% of full fine-tuning's.

Both fine-tunes keep the same activation checkpointing setting (`--recompute`, as
`train.activation_checkpointing`; `selective` by default, the best of the three for adapters
here): recomputing, the saved activations, which adapters do not shrink, no longer hide what they
do save.

    python benchmarks/lora.py [--steps 100] [--ranks 2] [--repeats 3] [--recompute none|selective|full]

The last line printed is JSON (`_report`'s shape).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import emit, limit_figure, ratio_figure

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.storage.base import local_path
from trnflow.workload.synth import synthesize

BASE = {"model_type": "llama", "vocab_size": 2048, "seq_len": 96,
        "config": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
                   "num_key_value_heads": 6, "tie_word_embeddings": True}}
LORA = {"r": 4, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]}


def _spec(root: Path, name: str, params: dict, data: dict, steps: int, ranks: int, lr: float,
          recompute: str = "none"):
    return quickstart(root, name=name, model={"recipe": "hf-causal-lm", "params": params}, data=data,
                      compute={"cores_per_node": ranks, "precision": "fp32", "threads_per_core": 1},
                      compile={"cache_url": str(root / "cache")},
                      train={"steps": steps, "global_batch_size": 16, "lr": lr, "checkpoint_every": steps,
                             "log_every": 10, "checkpoint_url": str(root / "checkpoints" / name), "seed": 3,
                             "activation_checkpointing": recompute},
                      gate={"reference": None, "metric": "perplexity", "metrics": [], "eval_every": steps,
                            "max_abs_diff": None, "max_rel_diff": 0.02})


def _checkpoint_bytes(url: str) -> int:
    return sum(f.stat().st_size for f in local_path(url).rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--recompute", choices=("none", "selective", "full"), default="selective",
                        help="train.activation_checkpointing of both fine-tunes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        synthesize(root / "chats", days=1, rows_per_day=1000, seed=5, fmt="chat", holdout_rows=200, inference_rows=10)
        chats = {"train": str(root / "chats" / "train"), "holdout": str(root / "chats" / "holdout"),
                 "inference": str(root / "chats" / "inference"), "format": "jsonl"}
        base = run_job(backend, _spec(root, "base", {**BASE, "rows": "text"}, {}, args.base_steps, args.ranks, 0.003),
                       "train", "base")
        from trnflow.workload.checkpoint import load  # torch: after the jobs' own imports have warmed up

        folder = str(local_path(load(base["checkpoint"]).meta.export))
        tuned = {"full": {"pretrained": folder, "seq_len": 96, "rows": "chat"},
                 "lora": {"pretrained": folder, "seq_len": 96, "rows": "chat", "lora": LORA}}
        lr = {"full": 0.001, "lora": 0.002}  # of 0.02, 0.005 and 0.002, the adapters' best perplexity
        specs = {k: _spec(root, f"chat-{k}", p, chats, args.steps, args.ranks, lr[k], args.recompute)
                 for k, p in tuned.items()}
        results: dict[str, list[dict]] = {"full": [], "lora": []}
        for i in range(args.repeats):
            for kind in (("full", "lora") if i % 2 == 0 else ("lora", "full")):
                results[kind].append(run_job(backend, specs[kind], "train", f"{kind}-{i}"))
                print(f"repeat {i + 1} {kind}: step {results[kind][-1]['median_step_seconds'] * 1000:.2f} ms",
                      flush=True)
        sizes = {k: _checkpoint_bytes(v[0]["checkpoint"]) for k, v in results.items()}  # before the folder goes
    step = {k: [r["median_step_seconds"] for r in v] for k, v in results.items()}
    memory = {k: v[0]["device_memory"] for k, v in results.items()}
    perplexity = {k: v[0]["evaluations"][-1]["perplexity"] for k, v in results.items()}
    share = memory["lora"]["gradients"] / max(memory["full"]["gradients"], 1)
    print(f"{args.ranks} ranks, {args.steps} steps: step {statistics.median(step['lora']) * 1000:.1f} ms (lora) vs "
          f"{statistics.median(step['full']) * 1000:.1f} ms (full); memory per rank "
          f"{memory['lora']['total'] / 2**20:.1f} vs {memory['full']['total'] / 2**20:.1f} MiB; checkpoint "
          f"{sizes['lora'] / 2**10:.0f} vs {sizes['full'] / 2**10:.0f} KiB; holdout perplexity "
          f"{perplexity['lora']:.4f} vs {perplexity['full']:.4f}; {share:.2%} of the weights train")
    figures = [
        ratio_figure("step time, lora over full", step["lora"], step["full"], unit="s",
                     baseline_name="full fine-tuning", better="lower", goal=0.8),
        limit_figure("memory per rank, lora over full", [memory["lora"]["total"] / memory["full"]["total"]], 0.6,
                     unit="x"),
        limit_figure("checkpoint bytes, lora over full", [sizes["lora"] / sizes["full"]], 0.02, unit="x"),
        limit_figure("holdout perplexity, |lora / full - 1|", [abs(perplexity["lora"] / perplexity["full"] - 1)],
                     0.05, unit="x"),
    ]
    emit("lora", figures, ranks=args.ranks, steps=args.steps, recompute=args.recompute, trainable_share=round(share, 5),
         step_seconds=step, memory_per_rank=memory, checkpoint_bytes=sizes, perplexity=perplexity)


if __name__ == "__main__":
    main()
