"""How an inference plan's cost grows with its shards: for 100, 550 and 1,000 shards of 2 rows, the
wall time of an inference job killed a quarter of the way through (rank 0, SIGKILL), the rerun that
finishes it (reusing every committed shard), and publishing the result (the pointer to the
manifest's folder). Each is a real job through the local backend on 2 cores.

Linear growth means the cost of a shard is the same at any size: the figure is the slope from 550
to 1,000 shards over the slope from 100 to 550 (seconds per extra shard), which fixed costs (process
start-up, loading the program) cancel out of. Goal: at most 1.3, where a cost quadratic in shards
would give about 2.3.

    python benchmarks/scale_inference.py [--sizes 100 550 1000] [--repeats 2]

The last line printed is JSON (`_report`'s shape), with {"seconds": {shards: [...]}, "slopes": [...]}.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import emit, limit_figure

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings
from trnflow.workload.embeddings import point_current, version_url
from trnflow.workload.synth import synthesize

ROWS_PER_SHARD = 2


def one_size(backend: LocalBackend, root: Path, checkpoint: str, shards: int, tag: str, repeat: int) -> float:
    """Seconds to run `shards` shards killed a quarter through, rerun them to the end and publish.
    A fault fires once per checkpoint's run (its marker is kept there), so each repeat kills at a
    shard of its own."""
    data = root / f"data-{shards}"
    if not data.exists():
        synthesize(data, days=1, rows_per_day=50, seed=5, holdout_rows=10, inference_rows=shards * ROWS_PER_SHARD)
    published = root / f"published-{tag}"
    sections = {"data": {"inference": str(data / "inference")},
                "compile": {"cache_url": str(root / "cache")}, "train": {"steps": 10, "checkpoint_every": 10},
                "inference": {"shard_size": ROWS_PER_SHARD, "output_url": version_url(str(published), 1)}}
    began = time.perf_counter()
    killed = quickstart(root, **sections, faults=[{"kind": "kill", "core": 0, "step": max(2, shards // 8) + repeat}])
    info = wait(backend, backend.submit(JobRequest(killed, "infer", tag, checkpoint=checkpoint)), 0.1)
    if info.state is not JobState.FAILED:
        raise SystemExit(f"the killed run of {shards} shards ended {info.state}, not failed")
    rerun = run_job(backend, quickstart(root, **sections), "infer", tag, checkpoint)
    if rerun["shards_reused"] == 0:
        raise SystemExit(f"the rerun of {shards} shards reused nothing")
    pointer = point_current(str(published), "bench", 1)
    if pointer["shards"] != shards:
        raise SystemExit(f"published {pointer['shards']} shards, not {shards}")
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs=3, default=[100, 550, 1000])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    small, middle, large = args.sizes
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        base = {"compile": {"cache_url": str(root / "cache")}, "train": {"steps": 10, "checkpoint_every": 10}}
        checkpoint = run_job(backend, quickstart(root, **base), "train", "bench")["checkpoint"]
        seconds: dict[int, list[float]] = {n: [] for n in args.sizes}
        slopes = []
        for repeat in range(args.repeats):
            for n in args.sizes:
                seconds[n].append(one_size(backend, root, checkpoint, n, f"r{repeat}-{n}", repeat))
            first = (seconds[middle][-1] - seconds[small][-1]) / (middle - small)
            second = (seconds[large][-1] - seconds[middle][-1]) / (large - middle)
            slopes.append(second / first)
            print(f"repeat {repeat + 1}: " + ", ".join(f"{n} shards {seconds[n][-1]:.1f} s" for n in args.sizes)
                  + f"; ms per extra shard {first * 1000:.1f} then {second * 1000:.1f}", flush=True)
    medians = {n: statistics.median(v) for n, v in seconds.items()}
    print("kill, rerun and publish: " + ", ".join(f"{n} shards {s:.1f} s" for n, s in medians.items())
          + f"; slope ratio {statistics.median(slopes):.2f} (1 is linear)")
    emit("scale_inference", [limit_figure(f"per-shard cost, {middle}-{large} over {small}-{middle} shards", slopes,
                                          1.3, unit="slope ratio")],
         seconds={str(n): v for n, v in seconds.items()}, slopes=slopes, rows_per_shard=ROWS_PER_SHARD)


if __name__ == "__main__":
    main()
