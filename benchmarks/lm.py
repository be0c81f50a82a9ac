"""Activation checkpointing, sequence packing and generation with a cache on a Llama-style decoder.

`--part checkpointing`: memory per rank and step time with each `train.activation_checkpointing`
setting, the losses alike.

The decoder (hidden 384, 4 layers, 6 heads, a 2,048-token vocabulary, rows of 96 tokens) trains from
scratch on review text on `--ranks` ranks, `--steps` steps at a global batch of 16, in fp32, once
with each setting: `none` (every activation saved for the backward pass), `selective` (the matrix
products' and attention's outputs kept, the rest recomputed) and `full` (each block's input kept,
the block recomputed). Compared, against `none` in the same run:

- memory per rank (weights, gradients, optimizer state and saved activations, as the training job
  measures them on its first step): goal at most 0.6x with full recomputation;
- step time (each run's median step after its graphs are loaded): what the memory costs;
- the final loss: goal equal (recomputation replays the same operations).

`--part packing`: the same decoder on synthetic chats (`trnflow data synth --format chat`: a
system instruction, a review and its sentiment, every third chat a second exchange; 46 to 96
tokens, 64 on average), `--steps` steps on one rank, once with a row a window and once packed
(`data.packing`), each at a global batch of 16 windows, in windows of 112 tokens (the chat LoRA
example's `seq_len`, which its longest chats nearly fill) and of 256 (room for a longer chat).
Compared: useful tokens per second (the real, non-padding tokens a step trains on, over the median
step time; the packed run counts the rows' real tokens, the same whether packed or not), goal at
least 2x unpacked. At 112 no packing can reach it on these chats: unpacked they fill 57% of a
window already, so even windows packed whole would be 1.75x.

`--part generation`: a smaller decoder of the same kind (hidden 128, 2 layers), trained one step on
review text (rows of 96 tokens: trained longer, it ends each review at once, where the text does;
nearly untrained, its completions run on), then generating greedy completions of 16 rows in one
batch, once with the cache of keys and values (`inference.generate.kv_cache`, the default: a
prefill, then one token a step) and once without (each step the whole buffer of 96 + new tokens),
at 16, 64 and 256 new tokens. Compared: generated tokens per second (the completions' tokens over
the inference stage's steady time, its programs loaded before), goal at least 5x at 256 new tokens;
and the completions, which must be the same.

    python benchmarks/lm.py [--part checkpointing|packing|generation|all] [--steps 20] [--ranks 2]

The last line printed is JSON (`_report`'s shape).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import difference_figure, emit, ratio_figure

from trnflow.backends.local import LocalBackend
from trnflow.results import PackingFill
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec
from trnflow.workload.synth import synthesize

DECODER = {"model_type": "llama", "vocab_size": 2048, "seq_len": 96, "rows": "text",
           "config": {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
                      "num_key_value_heads": 6, "tie_word_embeddings": True}}
SETTINGS = ("none", "selective", "full")


def _checkpointing(args: argparse.Namespace, root: Path, backend: LocalBackend) -> list[dict]:
    results: dict[str, dict] = {}
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
    args.details.update(memory_per_rank=memory, step_seconds=step, loss=loss)
    return figures


def _packing(args: argparse.Namespace, root: Path, backend: LocalBackend) -> list[dict]:
    chats = root / "chats"
    synthesize(chats, days=1, rows_per_day=1000, seed=11, fmt="chat", holdout_rows=200, inference_rows=20)
    useful: dict[str, float] = {}
    for seq_len in (112, 256):
        step: dict[bool, float] = {}
        fill = None
        for packing in (True, False):
            name = f"{'packed' if packing else 'unpacked'}-{seq_len}"
            spec = quickstart(root, name=f"chat-{name}", model={"recipe": "hf-causal-lm", "params": {
                                  **DECODER, "rows": "chat", "seq_len": seq_len}},
                              data={"train": str(chats / "train"), "holdout": str(chats / "holdout"),
                                    "inference": str(chats / "inference"), "packing": packing},
                              compute={"cores_per_node": 1, "precision": "fp32", "threads_per_core": 1},
                              compile={"cache_url": str(root / "cache")},
                              train={"steps": args.steps, "global_batch_size": 16, "lr": 0.003, "seed": 3,
                                     "checkpoint_every": args.steps, "log_every": args.steps,
                                     "checkpoint_url": str(root / "checkpoints" / name)},
                              gate={"reference": None, "metric": "perplexity", "metrics": [], "eval_every": None})
            ran = run_job(backend, spec, "train", f"chat-{name}")
            step[packing] = ran["median_step_seconds"]
            fill = PackingFill(**ran["packing"]) if packing else fill
        assert fill is not None
        # the same rows, cut alike, whether packed or not: the packed run counted their real tokens
        for packing, share in ((False, fill.unpacked), (True, fill.fill)):
            name = f"{'packed' if packing else 'unpacked'}-{seq_len}"
            useful[name] = share * seq_len * 16 / step[packing]
            print(f"{name}: {share * seq_len:.1f} real tokens a window of {seq_len}, step {step[packing] * 1000:.1f} "
                  f"ms, {useful[name]:.0f} useful tokens/s" + (f"; {fill}" if packing else ""), flush=True)
    args.details.update(useful_tokens_per_s=useful)
    return [ratio_figure("useful tokens per second on chats in windows of 112, packed over a row a window",
                         [useful["packed-112"]], [useful["unpacked-112"]], unit="tokens/s",
                         baseline_name="a row a window", better="higher", goal=2.0),
            ratio_figure("useful tokens per second on chats in windows of 256, packed over a row a window",
                         [useful["packed-256"]], [useful["unpacked-256"]], unit="tokens/s",
                         baseline_name="a row a window", better="higher")]


GENERATOR = {**DECODER, "config": {**DECODER["config"], "hidden_size": 128, "intermediate_size": 256,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}}
NEW_TOKENS = (16, 64, 256)


def _generation(args: argparse.Namespace, root: Path, backend: LocalBackend) -> list[dict]:
    import pyarrow.parquet as pq

    texts = root / "generation"
    synthesize(texts, days=1, rows_per_day=400, seed=13, holdout_rows=64, inference_rows=16)

    def spec(name: str, **generate: object) -> JobSpec:
        return quickstart(root, name=name, model={"recipe": "hf-causal-lm", "params": GENERATOR},
                          data={"train": str(texts / "train"), "holdout": str(texts / "holdout"),
                                "inference": str(texts / "inference")},
                          compute={"cores_per_node": 1, "precision": "fp32", "threads_per_core": 1},
                          compile={"cache_url": str(root / "cache")},
                          train={"steps": 1, "global_batch_size": 16, "lr": 0.003, "seed": 3,
                                 "checkpoint_every": 1, "log_every": 1,
                                 "checkpoint_url": str(root / "checkpoints" / "generator")},
                          inference={"batch_size": 16, "shard_size": 16, "output_url": str(root / name),
                                     **({"generate": generate} if generate else {})},
                          gate={"reference": None, "metric": "perplexity", "metrics": []})

    checkpoint = run_job(backend, spec("generator"), "train", "generator")["checkpoint"]
    rate: dict[str, float] = {}
    said: dict[str, dict] = {}
    for new in NEW_TOKENS:
        for cached in (True, False):
            name = f"{'cache' if cached else 'no-cache'}-{new}"
            ran = run_job(backend, spec(name, max_new_tokens=new, kv_cache=cached), "infer", name, checkpoint)
            table = pq.read_table(root / name, columns=["id", "completion", "completion_tokens"])
            tokens = sum(table.column("completion_tokens").to_pylist())
            rate[name] = tokens / ran["rows"] * ran["rows_per_s"]
            said[name] = dict(zip(table.column("id").to_pylist(), table.column("completion").to_pylist(), strict=True))
            print(f"{name}: {tokens} tokens for {ran['rows']} rows, {rate[name]:.1f} tokens/s", flush=True)
            args.details.setdefault("generated_tokens", {})[name] = tokens
    differ = sum(said[f"cache-{new}"][row] != said[f"no-cache-{new}"].get(row) for new in NEW_TOKENS
                 for row in said[f"cache-{new}"])
    args.details.update(generated_tokens_per_s=rate, completions_differing=differ, generator_steps=1)
    return [*(ratio_figure(f"generated tokens per second at {new} new tokens, with the cache over without",
                           [rate[f"cache-{new}"]], [rate[f"no-cache-{new}"]], unit="tokens/s",
                           baseline_name="the whole buffer each step", better="higher",
                           goal=5.0 if new == NEW_TOKENS[-1] else None) for new in NEW_TOKENS),
            difference_figure("completions that differ with the cache", [float(differ)], [0.0], unit="rows",
                              baseline_name="without the cache", goal=0.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("checkpointing", "packing", "generation", "all"), default="all")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    args.details = {"ranks": args.ranks, "steps": args.steps}
    figures: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        for part, measure in (("checkpointing", _checkpointing), ("packing", _packing), ("generation", _generation)):
            if args.part in (part, "all"):
                figures += measure(args, root, backend)
    emit("lm", figures, **args.details)


if __name__ == "__main__":
    main()
