"""The local backend's cost per stage job: trnflow's submit/wait against launching torchrun directly.

Both run the same workload phase (sanity, a few milliseconds of tensor work) on the same cores, so
the difference is what trnflow adds around a job: the supervisor process, job records, polling.

    python benchmarks/backend_overhead.py [--repeats 3]

The last line printed is JSON (`_report`'s shape), with {"direct_s", "trnflow_s", "overhead_ratio"}.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from _report import emit, ratio_figure

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.neuron.launch import launch_command, launch_env
from trnflow.specs import validate_spec
from trnflow.workload.synth import synthesize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        synthesize(root / "data", days=1, rows_per_day=64, seed=0)
        spec = validate_spec({
            "name": "bench",
            "data": {"train": str(root / "data/train"), "holdout": str(root / "data/holdout"),
                     "inference": str(root / "data/inference")},
            "train": {"steps": 1, "global_batch_size": 2, "checkpoint_url": str(root / "ckpt")},
            "inference": {"output_url": str(root / "out")},
        })
        backend = LocalBackend(root / "jobs")
        direct, through = [], []
        for i in range(args.repeats):
            job_dir = root / f"direct-{i}"
            (job_dir / "output").mkdir(parents=True)
            (job_dir / "spec.json").write_text(spec.model_dump_json())
            began = time.perf_counter()
            env = launch_env(spec, [0, 1], spec.compute.instance_type)
            subprocess.run(launch_command("sanity", 2, job_dir, "bench"), env=env, check=True, capture_output=True)
            direct.append(time.perf_counter() - began)

            began = time.perf_counter()
            info = wait(backend, backend.submit(JobRequest(spec, "sanity", "bench")), poll_seconds=0.05)
            through.append(time.perf_counter() - began)
            if info.state is not JobState.SUCCEEDED:
                raise SystemExit(f"the sanity job through the local backend failed: {info.failure}")
        d, t = statistics.median(direct), statistics.median(through)
        print(f"direct torchrun: {d:.2f}s   through trnflow's local backend: {t:.2f}s (median of {args.repeats})")
        emit("backend_overhead", [ratio_figure("seconds per stage job", through, direct, unit="s",
                                               baseline_name="torchrun directly", better="lower")],
             direct_s=round(d, 3), trnflow_s=round(t, 3), overhead_ratio=round(t / d, 3))


if __name__ == "__main__":
    main()
