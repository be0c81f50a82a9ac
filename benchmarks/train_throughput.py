"""trnflow's training stage against the best bare PyTorch DDP loop of the same model, batch and world size,
on the same kind of rows (the spec's texts, tokenized and padded as the job's are).

The baseline is the faster of two bare loops, each its own torchrun process group on gloo with one
thread per rank, each rank pinned to a CPU of its own (as trnflow's workers are, with
`compute.threads_per_core: 1`): plain eager, and the model under `torch.compile` (TorchInductor) with DDP around
it. Whichever has the better median step is the one trnflow is held to. trnflow's number comes from
a real training job through the local backend: the compiled train program from the compile cache,
the sampler, stochastic rounding when the spec asks for it, logging and a checkpoint every
`checkpoint_every` steps included. Each reports its median step time after the graph is loaded
or compiled. Goal: a samples/s ratio of at least 0.95.

    python benchmarks/train_throughput.py [--steps 300] [--ranks 2] [--optlevel 1] [--repeats 5]

The last line printed is JSON (`_report`'s shape), with {"trnflow_samples_per_s",
"bare_samples_per_s", "ratio", "baseline", "bare_eager_samples_per_s", "bare_compiled_samples_per_s"}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import emit, ratio_figure
from _torchrun import torchrun_json

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings

BARE = ("eager", "compiled")


def bare(spec_file: Path, ranks: int, steps: int, mode: str) -> float:
    return torchrun_json("_bare_ddp.py", ranks, spec_file, steps, mode)["median_step_seconds"]


def trnflow(backend: LocalBackend, spec, run_id: str) -> float:
    return run_job(backend, spec, "train", run_id)["median_step_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--optlevel", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "bf16-rne", "bf16-sr"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        spec = quickstart(root, compute={"cores_per_node": args.ranks, "instance_type": "trn1.32xlarge",
                                         "precision": args.precision, "threads_per_core": 1},
                          compile={"optlevel": args.optlevel, "cache_url": str(root / "cache")},
                          train={"steps": args.steps, "checkpoint_every": args.steps // 2, "log_every": 10})
        spec_file = root / "spec.json"
        spec_file.write_text(spec.model_dump_json())
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        trnflow(backend, spec, "warm-up")  # compiles the train program into the cache once
        ours: list[float] = []
        theirs: dict[str, list[float]] = {mode: [] for mode in BARE}
        runs = ("trnflow", *BARE)
        for i in range(args.repeats):  # interleaved, each repeat starting with another, so drift hits all alike
            for what in runs[i % len(runs):] + runs[:i % len(runs)]:
                if what == "trnflow":
                    ours.append(trnflow(backend, spec, f"run-{i}"))
                else:
                    theirs[what].append(bare(spec_file, args.ranks, args.steps, what))
            print(f"repeat {i + 1}: step ms trnflow {ours[-1] * 1000:.2f}, "
                  + ", ".join(f"bare {m} {theirs[m][-1] * 1000:.2f}" for m in BARE), flush=True)
    batch = spec.train.global_batch_size
    best = min(BARE, key=lambda m: statistics.median(theirs[m]))
    rate = {m: batch / statistics.median(theirs[m]) for m in BARE}
    t, b = batch / statistics.median(ours), rate[best]
    print(f"{args.ranks} ranks, global batch {batch}, O{args.optlevel}, {args.precision}: trnflow {t:.1f} samples/s, "
          f"bare DDP eager {rate['eager']:.1f}, compiled {rate['compiled']:.1f} samples/s "
          f"(median step of {args.repeats} runs; the baseline is {best})")
    samples = [batch / s for s in ours]
    emit("train_throughput", [ratio_figure("training samples/s", samples, [batch / s for s in theirs[best]],
                                           unit="samples/s", baseline_name=f"bare DDP ({best})", goal=0.95)],
         ranks=args.ranks, optlevel=args.optlevel, precision=args.precision, baseline=best,
         trnflow_samples_per_s=round(t, 1), bare_samples_per_s=round(b, 1), ratio=round(t / b, 3),
         bare_eager_samples_per_s=round(rate["eager"], 1), bare_compiled_samples_per_s=round(rate["compiled"], 1),
         step_seconds={"trnflow": ours, **theirs})


if __name__ == "__main__":
    main()
