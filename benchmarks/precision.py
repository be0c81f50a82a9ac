"""Holdout accuracy of the quickstart model trained in fp32 and three bf16 variants, over several
seeds, in two regimes: does stochastic rounding match fp32, and when does it matter?

Variants (`compute.precision`):
- `fp32`: the baseline;
- `bf16-rne`: pure bf16, weights and Adam's moments rounded to nearest even after each update;
- `bf16-sr`: pure bf16, rounded stochastically (what Trainium does with NEURON_RT_STOCHASTIC_ROUNDING_EN=1);
- `bf16`: bf16 autocast over fp32 master weights.

Regimes:
- `standard`: the quickstart's learning rate: updates well above bf16's spacing, so all should agree;
- `small-updates`: a learning rate several times smaller over twice the steps: Adam moves each
  weight by about the learning rate a step, which for most of the word embeddings (around 1 in
  size, where bf16's spacing is 2^-8 to 2^-7) is under half the spacing, so round-to-nearest drops
  those updates and learning stalls, while stochastic rounding keeps them in expectation.

Each (regime, variant, seed) is one real training job through the local backend, on one core,
which evaluates the whole holdout at its last step. The jobs run side by side, one on each of the
instance's cores as far as the host's CPUs go (`--parallel`), each worker pinned to CPUs of its
own with the same number of threads (`compute.threads_per_core`). A seed fixes the initial
weights, the data order and the rounding stream, so each variant is compared with fp32 on the same
seed (a paired difference), and the mean difference is given with its 95% confidence interval
(Student's t).

    python benchmarks/precision.py [--seeds 5] [--holdout 20000] [--regimes standard small-updates]
                                   [--parallel N]

The last line printed is JSON: a figure per regime and variant (its paired difference from fp32),
and per regime each variant's accuracy (mean, interval, values) and the verdict on stochastic rounding.
"""

from __future__ import annotations

import argparse
import os
import queue
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import difference_figure, emit
from _stats import interval, paired, show

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.specs import instance
from trnflow.workload.synth import synthesize

VARIANTS = ("fp32", "bf16-rne", "bf16-sr", "bf16")
REGIMES = {
    "standard": {"lr": 0.002, "steps": 300},
    "small-updates": {"lr": 0.0003, "steps": 600},
}
WITHIN = 0.001
"""The claim to test: stochastic rounding within 0.1 accuracy points of fp32."""


def train(backend: LocalBackend, root: Path, regime: str, precision: str, seed: int, threads: int,
          cores: queue.Queue) -> float:
    """One training job on a free core (taken from `cores` and given back); its holdout accuracy."""
    lr, steps = REGIMES[regime]["lr"], REGIMES[regime]["steps"]
    spec = quickstart(root, compute={"precision": precision, "cores_per_node": 1, "threads_per_core": threads},
                      compile={"cache_url": str(root / "cache")},
                      train={"steps": steps, "checkpoint_every": steps, "lr": lr, "seed": seed, "log_every": steps},
                      gate={"eval_every": None, "metrics": []})
    core = cores.get()
    try:
        result = run_job(backend, spec, "train", f"{regime}-{precision}-{seed}", cores=(core,))
    finally:
        cores.put(core)
    return result["evaluations"][-1]["accuracy"]


def verdict(diffs: dict) -> dict:
    """Whether SR is within WITHIN of fp32 (its mean difference, and its whole interval) and closer
    to fp32 than round-to-nearest."""
    sr, rne = diffs["bf16-sr"], diffs["bf16-rne"]
    return {"sr_mean_within": abs(sr["mean"]) <= WITHIN,
            "sr_interval_within": sr["low"] >= -WITHIN and sr["high"] <= WITHIN,
            "sr_closer_than_rne": abs(sr["mean"]) < abs(rne["mean"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5, help="Training seeds per variant (at least 2).")
    parser.add_argument("--holdout", type=int, default=20_000, help="Holdout rows each run is evaluated on.")
    parser.add_argument("--regimes", nargs="+", default=list(REGIMES), choices=list(REGIMES))
    parser.add_argument("--parallel", type=int, default=None,
                        help="Jobs at once, one a core (default: as many as the instance's cores and the host's "
                        "CPUs allow).")
    args = parser.parse_args()
    out: dict = {"holdout_rows": args.holdout, "seeds": args.seeds, "within": WITHIN, "regimes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        synthesize(root / "data", days=2, rows_per_day=2000, seed=7, holdout_rows=args.holdout, inference_rows=10)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        total = instance(quickstart(root).compute.instance_type).cores
        parallel = max(1, min(args.parallel or total, total, os.cpu_count() or 1))
        threads = max(1, (os.cpu_count() or 1) // parallel)
        cores: queue.Queue = queue.Queue()
        for core in range(parallel):
            cores.put(core)
        jobs = [(regime, seed, variant) for regime in args.regimes for seed in range(1, args.seeds + 1)
                for variant in VARIANTS]
        out |= {"parallel": parallel, "threads_per_core": threads}
        print(f"{len(jobs)} training jobs, {parallel} at once, {threads} CPU thread(s) each", flush=True)
        acc: dict[tuple[str, str, int], float] = {}
        pool = ThreadPoolExecutor(parallel)
        running = {job: pool.submit(train, backend, root, job[0], job[2], job[1], threads, cores) for job in jobs}
        try:
            for (regime, seed, variant), future in running.items():  # in order
                acc[regime, variant, seed] = future.result()
                if variant == VARIANTS[-1]:
                    print(f"{regime} seed {seed}: " + ", ".join(f"{v} {acc[regime, v, seed]:.4f}" for v in VARIANTS),
                          flush=True)
        finally:  # a failed job ends the run: the jobs not yet started never start
            pool.shutdown(cancel_futures=True)
        for regime in args.regimes:
            values = {v: [acc[regime, v, seed] for seed in range(1, args.seeds + 1)] for v in VARIANTS}
            stats = {v: interval(values[v]) for v in VARIANTS}
            diffs = {v: paired(values[v], values["fp32"]) for v in VARIANTS if v != "fp32"}
            out["regimes"][regime] = {**REGIMES[regime], "accuracy": stats, "minus_fp32": diffs,
                                      "verdict": verdict(diffs)}
    print(f"\nholdout accuracy in points, mean [95% interval] over {args.seeds} seeds, {args.holdout:,} rows each")
    for regime, r in out["regimes"].items():
        print(f"{regime} (lr {r['lr']}, {r['steps']} steps):")
        for v in VARIANTS:
            diff = f"   minus fp32 {show(r['minus_fp32'][v], 100)}" if v != "fp32" else ""
            print(f"  {v:9s} {show(r['accuracy'][v], 100)}{diff}")
        v = r["verdict"]
        print(f"  SR within {WITHIN * 100:.1f} point of fp32: mean {'yes' if v['sr_mean_within'] else 'NO'}, "
              f"whole interval {'yes' if v['sr_interval_within'] else 'no'}; "
              f"SR closer to fp32 than RNE: {'yes' if v['sr_closer_than_rne'] else 'NO'}")
    figures = [difference_figure(f"{v}, {regime}", r["accuracy"][v]["values"],
                                 r["accuracy"]["fp32"]["values"], unit="accuracy", baseline_name="fp32",
                                 goal=WITHIN if v == "bf16-sr" else None)
               for regime, r in out["regimes"].items() for v in VARIANTS if v != "fp32"]
    emit("precision", figures, **out)


if __name__ == "__main__":
    main()
