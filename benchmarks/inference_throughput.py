"""Embeddings/s of trnflow's inference stage against a bare `torch.inference_mode()` loop over the
same model and data, and how the stage scales from 1 to 2 to 4 cores.

Every core gets one host thread, pinned to a CPU of its own (`compute.threads_per_core: 1`), so
that scaling measures the cores and not threads that one core could have used too. The baseline
runs in this process on one thread, pinned to the CPU a one-core job's worker gets, batch by
batch over the tokenized rows, just before and just after each one-core job: a repeat's baseline
is the mean of the two, so that the machine's drift (this one's speed wanders by a quarter over
tens of seconds) hits both sides of the ratio alike. trnflow's numbers come
from real inference jobs through the local backend, one per core count, each into a fresh output
folder (so nothing is reused): the compiled embed program from the compile cache, Parquet shards
with their commit markers, and the manifest, included. rows/s counts the shard loop of the job
(not process start-up), the same span the baseline times.

    python benchmarks/inference_throughput.py [--rows 20000] [--shard-size 2500] [--cores 1 2 4] [--repeats 3]

The last line printed is JSON (`_report`'s shape), with {"bare_rows_per_s", "trnflow_rows_per_s",
"ratio", "scaling"}. Goals: a ratio of at least 0.95 on one core, and 2 cores at least 1.7x one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _quickstart import quickstart, run_job, scratch_home
from _report import emit, ratio_figure

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.workload.checkpoint import load
from trnflow.workload.data import read_unlabelled
from trnflow.workload.evaluate import featurized
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for
from trnflow.workload.sampler import static_batches
from trnflow.workload.synth import synthesize


def bare(spec, checkpoint: str, threads: int) -> float:
    """Rows/s of a plain inference_mode loop over the same model, rows and batch size, on `threads`
    threads pinned to the CPUs a one-core job's worker is pinned to, as that core has."""
    torch.set_num_threads(threads)
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(allowed)[:threads])
    try:
        return _bare_loop(spec, checkpoint)
    finally:
        os.sched_setaffinity(0, allowed)


def _bare_loop(spec, checkpoint: str) -> float:
    recipe = recipe_for(spec)
    ckpt = load(checkpoint, recipe.featurizer_file)
    model = build_model(recipe, spec.train.seed)
    model.load_state_dict(ckpt.model)
    model.eval()
    rows = read_unlabelled(spec.data.inference, spec.data, recipe.columns())
    tokens = featurized(recipe, ckpt).features(rows.table)
    began = time.perf_counter()
    with torch.inference_mode():
        for batch, real in static_batches(tokens, torch.arange(len(tokens)), spec.inference.batch_size):
            model.embed(batch)[:real].float().numpy()
    return len(tokens) / (time.perf_counter() - began)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--shard-size", type=int, default=2_500)
    parser.add_argument("--cores", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        synthesize(root / "data", days=2, rows_per_day=800, seed=7, inference_rows=args.rows)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        base = {"compile": {"cache_url": str(root / "cache")}, "train": {"steps": 10, "checkpoint_every": 10}}
        trained = run_job(backend, quickstart(root, **base), "train", "bench")
        first = args.cores[0]
        threads = 1  # each core's worker: threads_per_core
        if max(args.cores) > (os.cpu_count() or 1):
            print(f"note: {max(args.cores)} cores on {os.cpu_count()} CPUs share CPUs; their scaling is not the cores'")
        runs: dict[int, list[float]] = {c: [] for c in args.cores}
        bares = []
        for repeat in range(args.repeats):  # interleaved, so drift on the machine hits all alike
            before = bare(quickstart(root, **base), trained["checkpoint"], threads)
            for cores in args.cores:
                spec = quickstart(root, **base, compute={"cores_per_node": cores, "instance_type": "trn1.32xlarge",
                                                         "threads_per_core": threads},
                                  inference={"output_url": str(root / f"out-{cores}-{repeat}"),
                                             "shard_size": args.shard_size})
                runs[cores].append(run_job(backend, spec, "infer", "bench", trained["checkpoint"])["rows_per_s"])
                if cores == first:  # the baseline on either side of the job it is compared with
                    bares.append((before + bare(quickstart(root, **base), trained["checkpoint"], threads)) / 2)
            print(f"repeat {repeat + 1}: bare {bares[-1]:.0f} rows/s, trnflow "
                  + ", ".join(f"{c} core(s) {runs[c][-1]:.0f}" for c in args.cores), flush=True)
        ours = {c: statistics.median(v) for c, v in runs.items()}
        theirs = statistics.median(bares)
    print(f"medians: bare inference_mode loop on {threads} thread(s) {theirs:.0f} rows/s, trnflow "
          + ", ".join(f"{c} core(s) {ours[c]:.0f}" for c in args.cores))
    figures = [ratio_figure(f"embeddings/s on {first} core(s)", runs[first], bares, unit="rows/s",
                            baseline_name="bare inference_mode loop", goal=0.95)]
    figures += [ratio_figure(f"embeddings/s on {c} cores", runs[c], runs[first], unit="rows/s",
                             baseline_name=f"trnflow on {first} core(s)", goal=1.7 if c == 2 * first else None)
                for c in args.cores if c != first]
    emit("inference_throughput", figures, bare_rows_per_s=round(theirs, 1), trnflow_rows_per_s=ours,
         ratio=round(ours[first] / theirs, 3), scaling={str(c): round(ours[c] / ours[first], 2) for c in args.cores})


if __name__ == "__main__":
    main()
