"""`trnflow data`: make and inspect datasets."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from trnflow.cli.common import JsonOpt, SetOpt, SpecArg, console, err, load, set_overrides
from trnflow.cli.console import RED
from trnflow.errors import ExitCode
from trnflow.results import DataPartCheck

data_app = typer.Typer(help="Make and inspect datasets.", no_args_is_help=True)


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, typer.Argument(help="Output folder.")],
    days: Annotated[int, typer.Option(min=1, help="Daily training partitions.")] = 3,
    rows_per_day: Annotated[int, typer.Option(min=1, help="Rows per partition.")] = 1500,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 7,
    fmt: Annotated[str, typer.Option("--format", help="jsonl, parquet, csv or amazon-polarity; for a language model "
                                     "(hf-causal-lm), prompt-completion: JSONL rows of a review as the prompt and its "
                                     "label's word as the completion, or chat: JSONL rows of messages, the review "
                                     "from the user and the word from the assistant.")] = "jsonl",
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

    if fmt not in ("jsonl", "parquet", "csv", "amazon-polarity", "prompt-completion", "chat"):
        err.print(f"--format {fmt!r}: choose jsonl, parquet, csv, amazon-polarity, prompt-completion or chat", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    if out.exists() and not out.is_dir():
        err.print(f"OUT {out} is a file; give a folder (it will hold train/, holdout/ and inference/)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    summary = synthesize(out, days, rows_per_day, seed, fmt, holdout_rows, inference_rows, start=first,
                         train_only=train_only)
    console.print(f"wrote {summary['train_rows']} training rows in {summary['train_partitions']} partition(s), "
                  f"{summary['holdout_rows']} holdout and {summary['inference_rows']} inference rows to {out}")


STATE_STYLES = {"ok": "green", "failed": "red", "waiting": "cyan"}


def check_table(parts: list[DataPartCheck], title: str) -> Table:
    """A row per training day and per set: files, rows read and rejected, and why (printed as it is)."""
    table = Table("data", "day", "files", "rows read", "rows rejected", "state", "why", title=title)
    for p in parts:
        table.add_row(p.field, f"dt={p.day}" if p.day else "", str(len(p.files)), str(p.rows_read),
                      str(p.rows_rejected), Text(p.state, style=STATE_STYLES.get(p.state, "yellow")),
                      Text("; ".join([*p.problems, *p.notes])))
    return table


@data_app.command("check")
def data_check(spec_path: SpecArg, overrides: SetOpt = None, as_json: JsonOpt = False):
    """Read a spec's data as its runs do: per day of data.train, and for data.holdout and
    data.inference, the rows read and the rows rejected, with why (and, with data.packing, how full
    the training windows are). Exits 2 when a run would stop on
    one (a day with no readable rows, a file it cannot read)."""
    from trnflow.workload.datacheck import Tokens, check_data  # heavy: pyarrow
    from trnflow.workload.recipes import recipe_for

    spec = load(spec_path, set_overrides(overrides))
    recipe = recipe_for(spec)  # the recipe decides which columns a row needs, and counts its tokens
    tokens = (Tokens(recipe.token_lengths, recipe.input_length, spec.data.packing)
              if recipe.input_length is not None else None)
    parts = check_data(spec.data, recipe.columns(), recipe.num_classes, tokens)
    failed = [p for p in parts if p.state == "failed"]
    if as_json:
        print(json.dumps({"spec": str(spec_path), "format": spec.data.format, "columns": recipe.columns(),
                          "ok": not failed, "parts": [p.model_dump(mode="json") for p in parts]}, indent=2))
    else:
        console.print(check_table(parts, f"{spec.name}: {spec.data.format} data, columns "
                                         f"{', '.join(recipe.columns())}"))
        for p in failed:
            err.print(f"{p.field}{f' dt={p.day}' if p.day else ''}: {'; '.join(p.problems)}", **RED)
    raise typer.Exit(ExitCode.BAD_INPUT if failed else ExitCode.OK)
