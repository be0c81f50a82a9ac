"""trnflow's training steps on the `xla` device against a plain torch-xla loop of the same model,
batch and step count, on torch-xla's CPU runtime, one rank.

trnflow's number comes from a real training job through the local backend (sampler, tokenized
data, logging and checkpoints included); the baseline is the better of two plain loops, one
`torch_xla.sync()` per step (the usual loop) or two (after backward too, as trnflow syncs). Both
report the median step after the first (step 2 also compiles a graph; the median sees past it).
Goal: a ratio of at least 0.95. Run it in the XLA lane's environment:

    PJRT_DEVICE=CPU .venv/xla/bin/python benchmarks/xla_overhead.py [--steps 120] [--repeats 3]

The last line printed is JSON (`_report`'s shape), with {"trnflow_step_s", "plain_step_s", "ratio", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import emit, ratio_figure

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings

HERE = Path(__file__).resolve().parent


def plain(spec_file: Path, steps: int, syncs: int) -> float:
    done = subprocess.run([sys.executable, str(HERE / "_bare_xla.py"), str(spec_file), str(steps), str(syncs)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["median_step_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if os.environ.get("PJRT_DEVICE") != "CPU":
        raise SystemExit("set PJRT_DEVICE=CPU (torch-xla's CPU runtime) and run in the XLA lane's environment")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        spec = quickstart(root, compute={"cores_per_node": 1, "device": "xla"},
                          compile={"cache_url": str(root / "cache")},
                          train={"steps": args.steps, "checkpoint_every": args.steps, "log_every": 20},
                          gate={"eval_every": args.steps})
        spec_file = root / "spec.json"
        spec_file.write_text(spec.model_dump_json())
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        ours, one_sync, two_syncs = [], [], []
        for i in range(args.repeats):  # interleaved, so drift on the machine hits all alike
            one_sync.append(plain(spec_file, args.steps, 1))
            two_syncs.append(plain(spec_file, args.steps, 2))
            ours.append(run_job(backend, spec, "train", f"run-{i}")["median_step_seconds"])
    t = statistics.median(ours)
    p1, p2 = statistics.median(one_sync), statistics.median(two_syncs)
    best = min(p1, p2)
    print(f"global batch {spec.train.global_batch_size}, {args.steps} steps: trnflow {t * 1e3:.2f} ms/step, plain "
          f"torch-xla {p1 * 1e3:.2f} ms (one sync) and {p2 * 1e3:.2f} ms (two syncs); median of {args.repeats} runs")
    plain_best = one_sync if p1 <= p2 else two_syncs
    emit("xla_overhead", [ratio_figure("seconds per training step", ours, plain_best, unit="s",
                                       baseline_name=f"plain torch-xla ({'one sync' if p1 <= p2 else 'two syncs'})",
                                       better="lower", goal=round(1 / 0.95, 4))],
         trnflow_step_s=round(t, 5), plain_step_s=round(best, 5), plain_one_sync_step_s=round(p1, 5),
         plain_two_syncs_step_s=round(p2, 5), ratio=round(best / t, 3),
         repeats={"trnflow": ours, "one_sync": one_sync, "two_syncs": two_syncs})


if __name__ == "__main__":
    main()
