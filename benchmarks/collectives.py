"""trnflow's all-reduce test against a bare torch.distributed gloo loop of the same size and ranks.

Both run under torchrun with one thread per rank; trnflow's number comes from its collectives job
(launched through the local backend, results checked off) and the baseline from
`_bare_allreduce.py`. Goal: busbw ratio of at least 0.9 at 16 MiB with 4 ranks.

    python benchmarks/collectives.py [--ranks 4] [--size 16MB] [--iters 10] [--repeats 5]

The last line printed is JSON (`_report`'s shape), with {"size", "ranks", "trnflow_busbw", "bare_busbw",
"busbw_ratio"}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from _report import emit, ratio_figure
from _torchrun import torchrun_json

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.cli.render import parse_size
from trnflow.neuron.nccom import bus_factor
from trnflow.workload.collectives import GIB


def bare_busbw(ranks: int, size: int, iters: int) -> float:
    seconds = torchrun_json("_bare_allreduce.py", ranks, size, iters)["seconds"]
    return size / seconds / GIB * bus_factor("all_reduce", ranks)


def trnflow_busbw(backend: LocalBackend, ranks: int, size: int, iters: int) -> float:
    options = {"ops": ["all_reduce"], "minbytes": size, "maxbytes": size, "stepfactor": 1, "iters": iters,
               "warmup": 1, "dtype": "fp32", "check": False}
    info = wait(backend, backend.submit(JobRequest(None, "collectives", "bench", processes=ranks, options=options)),
                0.1)
    if info.state is not JobState.SUCCEEDED:
        raise SystemExit(f"trnflow collectives job failed: {info.failure}")
    assert info.result is not None, info.failed()
    return info.result.rows[0].busbw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size", default="16MB")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = parse_size(args.size)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TRNFLOW_NEURON_RT_DIR", str(Path(tmp) / "rt"))
        backend = LocalBackend(Path(tmp) / "jobs")
        ours, bare = [], []
        for _ in range(args.repeats):  # interleaved, so drift on the machine hits both alike
            bare.append(bare_busbw(args.ranks, size, args.iters))
            ours.append(trnflow_busbw(backend, args.ranks, size, args.iters))
    t, b = statistics.median(ours), statistics.median(bare)
    print(f"all_reduce {size} B on {args.ranks} ranks: trnflow {t:.4f} GB/s, bare gloo {b:.4f} GB/s "
          f"(busbw, median of {args.repeats})")
    emit("collectives", [ratio_figure(f"all_reduce busbw, {args.ranks} ranks", ours, bare, unit="GB/s",
                                      baseline_name="bare gloo loop", goal=0.9)],
         size=size, ranks=args.ranks, trnflow_busbw=round(t, 4), bare_busbw=round(b, 4), busbw_ratio=round(t / b, 3))


if __name__ == "__main__":
    main()
