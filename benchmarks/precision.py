"""Holdout accuracy after the same training in fp32, bf16 (autocast) and bf16-sr (bf16 weights,
every update rounded stochastically), with the same seed, data and steps.

Each precision is a real training job and an evaluation job through the local backend. bf16-sr is
what lets Trainium train in bf16 without fp32 master weights; the figure to watch is
`sr_minus_fp32`, the accuracy it gives up (or gains) against fp32.

    python benchmarks/precision.py [--steps 300] [--lr 0.002]

The last line printed is JSON: {"fp32": ..., "bf16": ..., "bf16_sr": ..., "sr_minus_fp32": ...}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings

PRECISIONS = ("fp32", "bf16", "bf16-sr")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=0.002)
    args = parser.parse_args()
    accuracy = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        for precision in PRECISIONS:
            spec = quickstart(root, compute={"precision": precision},
                              compile={"cache_url": str(root / "cache")},
                              train={"steps": args.steps, "checkpoint_every": args.steps, "lr": args.lr})
            trained = run_job(backend, spec, "train", precision)
            point = run_job(backend, spec, "evaluate", precision, trained["checkpoint"])["points"][0]
            accuracy[precision] = point["accuracy"]
            print(f"{precision:8s} loss {trained['loss']:.4f}  holdout accuracy {point['accuracy']:.4f} "
                  f"({point['rows']} rows)", flush=True)
    print(json.dumps({"steps": args.steps, "fp32": accuracy["fp32"], "bf16": accuracy["bf16"],
                      "bf16_sr": accuracy["bf16-sr"],
                      "sr_minus_fp32": round(accuracy["bf16-sr"] - accuracy["fp32"], 4)}))


if __name__ == "__main__":
    main()
