"""trnflow's training stage against a bare PyTorch DDP loop of the same model, batch and world size.

Both run on gloo with one thread per rank, as separate torchrun process groups; each reports the
median step time after the first step (which loads or compiles the graph). trnflow's number comes
from a real training job through the local backend: the compiled train program from the compile
cache, the sampler, logging and a checkpoint every `checkpoint_every` steps included. Goal: a
samples/s ratio of at least 0.95.

    python benchmarks/train_throughput.py [--steps 60] [--ranks 2] [--optlevel 1] [--repeats 3]

The last line printed is JSON: {"trnflow_samples_per_s": ..., "bare_samples_per_s": ..., "ratio": ...}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _torchrun import torchrun_json

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings


def bare(spec_file: Path, ranks: int, steps: int) -> float:
    return torchrun_json("_bare_ddp.py", ranks, spec_file, steps)["median_step_seconds"]


def trnflow(backend: LocalBackend, spec, run_id: str) -> float:
    return run_job(backend, spec, "train", run_id)["median_step_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--optlevel", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        spec = quickstart(root, compute={"cores_per_node": args.ranks, "instance_type": "trn1.32xlarge"},
                          compile={"optlevel": args.optlevel, "cache_url": str(root / "cache")},
                          train={"steps": args.steps, "checkpoint_every": args.steps // 2, "log_every": 10})
        spec_file = root / "spec.json"
        spec_file.write_text(spec.model_dump_json())
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        trnflow(backend, spec, "warm-up")  # compiles the train program into the cache once
        ours, theirs = [], []
        for i in range(args.repeats):  # interleaved, so drift on the machine hits both alike
            theirs.append(bare(spec_file, args.ranks, args.steps))
            ours.append(trnflow(backend, spec, f"run-{i}"))
    batch = spec.train.global_batch_size
    t, b = batch / statistics.median(ours), batch / statistics.median(theirs)
    print(f"{args.ranks} ranks, global batch {batch}, O{args.optlevel}: trnflow {t:.1f} samples/s, "
          f"bare DDP {b:.1f} samples/s (median step of {args.repeats} runs)")
    print(json.dumps({"ranks": args.ranks, "optlevel": args.optlevel, "trnflow_samples_per_s": round(t, 1),
                      "bare_samples_per_s": round(b, 1), "ratio": round(t / b, 3)}))


if __name__ == "__main__":
    main()
