"""Numeric rows for the tabular recipe: `python -m tabular_recipe.data OUT [--days 3] [--rows-per-day 1000]`.

Writes OUT/train/dt=YYYY-MM-DD/part-00000.parquet (one partition a day), OUT/holdout and
OUT/inference, each row with an `id`, four numeric columns `f0`..`f3` on different scales, and for
train and holdout a `label` that a linear rule of the columns decides, with 5% of labels flipped.
The same arguments always give the same files."""

from __future__ import annotations

import argparse
from datetime import date, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SCALES = np.array([1.0, 10.0, 0.1, 100.0])
WEIGHTS = np.array([1.5, -0.2, 8.0, 0.01])


def rows(rng: np.random.Generator, n: int, first_id: int, labelled: bool) -> pa.Table:
    x = rng.normal(size=(n, len(SCALES))) * SCALES
    columns = {"id": pa.array([f"row-{first_id + i}" for i in range(n)])}
    columns |= {f"f{j}": pa.array(x[:, j]) for j in range(len(SCALES))}
    if labelled:
        label = (x @ WEIGHTS > 0).astype(np.int64)
        flip = rng.random(n) < 0.05
        columns["label"] = pa.array(np.where(flip, 1 - label, label))
    return pa.table(columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--rows-per-day", type=int, default=1000)
    parser.add_argument("--holdout-rows", type=int, default=600)
    parser.add_argument("--inference-rows", type=int, default=500)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    for day in range(args.days):
        folder = args.out / "train" / f"dt={date(2026, 1, 1) + timedelta(days=day)}"
        folder.mkdir(parents=True, exist_ok=True)
        pq.write_table(rows(rng, args.rows_per_day, day * args.rows_per_day, True), folder / "part-00000.parquet")
    for name, n, labelled in (("holdout", args.holdout_rows, True), ("inference", args.inference_rows, False)):
        (args.out / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(rows(rng, n, 10_000_000 + n, labelled), args.out / name / "part-00000.parquet")


if __name__ == "__main__":
    main()
