"""`trnflow data`: make and inspect datasets."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Annotated

import typer

from trnflow.cli.common import console, err
from trnflow.cli.render import RED
from trnflow.errors import ExitCode

data_app = typer.Typer(help="Make and inspect datasets.", no_args_is_help=True)


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, typer.Argument(help="Output folder.")],
    days: Annotated[int, typer.Option(min=1, help="Daily training partitions.")] = 3,
    rows_per_day: Annotated[int, typer.Option(min=1, help="Rows per partition.")] = 1500,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 7,
    fmt: Annotated[str, typer.Option("--format", help="jsonl, parquet, csv or amazon-polarity.")] = "jsonl",
    holdout_rows: Annotated[int | None, typer.Option(help="Holdout rows (default: rows per day).")] = None,
    inference_rows: Annotated[int | None, typer.Option(help="Inference rows (default: rows per day).")] = None,
    start: Annotated[str, typer.Option(help="The first day, YYYY-MM-DD.")] = "2026-01-01",
    train_only: Annotated[bool, typer.Option("--train-only", help="Only add day partitions (new data arriving); "
                                             "keep holdout/ and inference/ as they are.")] = False,
):
    """Write synthetic product reviews: train/dt=*/, holdout/ and inference/."""
    from trnflow.workload.synth import synthesize  # heavy: numpy and pyarrow

    try:
        first = dt.date.fromisoformat(start)
    except ValueError:
        err.print(f"--start {start!r}: expected a date, YYYY-MM-DD", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None

    if fmt not in ("jsonl", "parquet", "csv", "amazon-polarity"):
        err.print(f"--format {fmt!r}: choose jsonl, parquet, csv or amazon-polarity", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    if out.exists() and not out.is_dir():
        err.print(f"OUT {out} is a file; give a folder (it will hold train/, holdout/ and inference/)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    summary = synthesize(out, days, rows_per_day, seed, fmt, holdout_rows, inference_rows, start=first,
                         train_only=train_only)
    console.print(f"wrote {summary['train_rows']} training rows in {summary['train_partitions']} partition(s), "
                  f"{summary['holdout_rows']} holdout and {summary['inference_rows']} inference rows to {out}")
