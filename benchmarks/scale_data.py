"""Streaming data at size: a 2,000,000-row training set in 40 daily partitions trains, and a
2,000,000-row inference set is embedded, on 2 cores, each rank's peak resident memory at most 1.5 GB.

The rows are read a batch at a time (`trnflow.workload.data`), the tokenizer learns from the stream,
and the featurized rows (2,000,000 x 32 token ids, 512 MB a set) go to local disk beyond
TRNFLOW_FEATURES_IN_MEMORY_MB (256 MB), from where each batch reads its rows. Each job is a real
job through the local backend; the figures are the peak resident set each rank reports (getrusage).

    python benchmarks/scale_data.py [--days 40] [--rows-per-day 50000] [--inference-rows 2000000]

The last line printed is JSON (`_report`'s shape).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import emit, limit_figure

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.workload.synth import synthesize

LIMIT_MB = 1536


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=40)
    parser.add_argument("--rows-per-day", type=int, default=50_000)
    parser.add_argument("--inference-rows", type=int, default=2_000_000)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        began = time.perf_counter()
        data = root / "data"
        synthesize(data, days=args.days, rows_per_day=args.rows_per_day, seed=9, holdout_rows=2000,
                   inference_rows=args.inference_rows)
        print(f"wrote {args.days * args.rows_per_day:,} training rows in {args.days} days and "
              f"{args.inference_rows:,} inference rows in {time.perf_counter() - began:.0f} s", flush=True)
        spec = quickstart(root, compile={"cache_url": str(root / "cache")},
                          train={"steps": args.steps, "checkpoint_every": args.steps, "log_every": args.steps},
                          gate={"eval_every": None}, inference={"shard_size": 100_000})
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        stages = {}
        for phase in ("train", "infer"):
            began = time.perf_counter()
            checkpoint = stages["train"]["checkpoint"] if phase == "infer" else None
            stages[phase] = run_job(backend, spec, phase, "scale", checkpoint)
            memory = stages[phase]["host_memory"]
            print(f"{phase}: {stages[phase]['rows']:,} rows in {time.perf_counter() - began:.0f} s; peak resident "
                  f"memory per rank {memory['peak_rss_mb_per_rank']} MB; featurized rows on disk: "
                  f"{memory['features_spilled_to_disk']}", flush=True)
    if stages["train"]["partitions"] != sorted(stages["train"]["partitions"]) or \
            len(stages["train"]["partitions"]) != args.days:
        raise SystemExit(f"trained on {len(stages['train']['partitions'])} partitions, not {args.days}")
    figures = [limit_figure(f"peak resident memory of a rank, {phase} on {stages[phase]['rows']:,} rows",
                            [max(stages[phase]["host_memory"]["peak_rss_mb_per_rank"])], LIMIT_MB, unit="MB")
               for phase in ("train", "infer")]
    emit("scale_data", figures, rows={p: stages[p]["rows"] for p in stages},
         host_memory={p: stages[p]["host_memory"] for p in stages}, partitions=len(stages["train"]["partitions"]))


if __name__ == "__main__":
    main()
