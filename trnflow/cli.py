"""The `trnflow` command: validate specs, inspect the emulated devices, make data, run the pipeline.

This is the composition root: it reads specs and settings, picks what to run and prints results.
Prefect is imported only by the commands that run flows, so the others start fast.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from jobspecs import CATALOGUE, JobSpec, SpecError, load_spec

app = typer.Typer(
    name="trnflow",
    help="Production training pipelines for AWS Trainium, with a local NeuronCore emulator.",
    no_args_is_help=True,
    add_completion=False,
)
data_app = typer.Typer(help="Make and inspect datasets.", no_args_is_help=True)
app.add_typer(data_app, name="data")

console = Console()
err = Console(stderr=True)

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_GATE = 1, 2, 3

SpecArg = Annotated[Path, typer.Argument(help="Job spec YAML file.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a spec field: --set train.steps=50 (repeatable; value parsed as YAML)."),
]


def _overrides(pairs: list[str] | None) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            err.print(f"[red]--set {pair!r}: expected FIELD=VALUE, for example --set train.steps=50[/red]")
            raise typer.Exit(EXIT_BAD_INPUT)
        out[key.strip()] = yaml.safe_load(value)
    return out


def _load(path: Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    try:
        return load_spec(path, overrides)
    except SpecError as exc:
        err.print(f"[red]{exc.source}: invalid job spec[/red]")
        for problem in exc.problems:
            err.print(f"  {problem}", markup=False, highlight=False)
        raise typer.Exit(EXIT_BAD_INPUT) from None


@app.command()
def validate(
    specs: Annotated[list[Path], typer.Argument(help="One or more job spec files.")],
    as_json: JsonOpt = False,
):
    """Check job specs; list every problem as `field.path: message`."""
    report, failed = [], False
    for path in specs:
        try:
            spec = load_spec(path)
            report.append({"file": str(path), "valid": True, "name": spec.name})
        except SpecError as exc:
            failed = True
            report.append({"file": str(path), "valid": False, "problems": exc.problems})
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        for item in report:
            if item["valid"]:
                console.print(f"[green]ok[/green] {item['file']} ({item['name']})")
            else:
                err.print(f"[red]invalid[/red] {item['file']}")
                for problem in item["problems"]:
                    err.print(f"  {problem}", markup=False, highlight=False)
    raise typer.Exit(EXIT_BAD_INPUT if failed else 0)


@app.command()
def schema():
    """Print the JSON Schema of a job spec (for editor completion of YAML specs)."""
    print(json.dumps(JobSpec.model_json_schema(), indent=2))


@app.command()
def devices(
    instance_type: Annotated[str, typer.Option(help="Instance type to emulate.")] = "trn1.2xlarge",
    as_json: JsonOpt = False,
):
    """List the emulated instance's Neuron devices, like `neuron-ls`."""
    from trnflow.emulator.topology import neuron_ls

    if instance_type not in CATALOGUE:
        err.print(f"[red]--instance-type {instance_type!r} is unknown; choose one of: {', '.join(CATALOGUE)}[/red]")
        raise typer.Exit(EXIT_BAD_INPUT)
    records = neuron_ls(instance_type)
    if as_json:
        print(json.dumps(records, indent=2))
        return
    t = CATALOGUE[instance_type]
    console.print(f"instance-type: {instance_type}  ({t.cores} NeuronCores, {t.chips} device(s))")
    table = Table("NEURON DEVICE", "NEURON CORES", "NEURON CORE IDS", "NEURON MEMORY", "CONNECTED DEVICES", "BDF")
    for r in records:
        ids = r["neuroncore_ids"]
        table.add_row(str(r["neuron_device"]), str(r["nc_count"]), f"{ids[0]}-{ids[-1]}",
                      f"{r['memory_size'] // 1024**3} GB", ", ".join(map(str, r["connected_to"])), r["bdf"])
    console.print(table)


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, typer.Argument(help="Output folder.")],
    days: Annotated[int, typer.Option(min=1, help="Daily training partitions.")] = 3,
    rows_per_day: Annotated[int, typer.Option(min=1, help="Rows per partition.")] = 1500,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 7,
    fmt: Annotated[str, typer.Option("--format", help="jsonl, parquet or csv.")] = "jsonl",
    holdout_rows: Annotated[int | None, typer.Option(help="Holdout rows (default: rows per day).")] = None,
    inference_rows: Annotated[int | None, typer.Option(help="Inference rows (default: rows per day).")] = None,
):
    """Write synthetic product reviews: train/dt=*/, holdout/ and inference/."""
    from trnflow.synth import synthesize

    if fmt not in ("jsonl", "parquet", "csv"):
        err.print(f"[red]--format {fmt!r}: choose jsonl, parquet or csv[/red]")
        raise typer.Exit(EXIT_BAD_INPUT)
    summary = synthesize(out, days, rows_per_day, seed, fmt, holdout_rows, inference_rows)
    console.print(f"wrote {summary['train_rows']} training rows in {summary['train_partitions']} partition(s), "
                  f"{summary['holdout_rows']} holdout and {summary['inference_rows']} inference rows to {out}")


@app.command()
def reference(spec_path: SpecArg, overrides: SetOpt = None):
    """Train the spec in plain fp32 (as a GPU run would) and write its metrics to gate.reference."""
    from trnflow.errors import TrnflowError
    from trnflow.reference import run_reference

    spec = _load(spec_path, _overrides(overrides))
    try:
        with console.status("training the fp32 reference"):
            document = run_reference(spec)
    except TrnflowError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(EXIT_FAILED) from None
    final = document["points"][-1]
    console.print(f"reference written to {spec.gate.reference}: step {final['step']}, "
                  f"accuracy {final['accuracy']:.4f}")


def _summary_table(rows: list[dict[str, Any]]) -> Table:
    from flows.pipeline import STAGES

    colours = {"Completed": "green", "Failed": "red", "NotRun": "dim"}
    table = Table("stage", "state", "duration", "key figure", title="trnflow pipeline")
    seen = {r["stage"] for r in rows}
    full = rows + [{"stage": s, "state": "NotRun", "seconds": None, "summary": ""} for s in STAGES if s not in seen]
    for r in full:
        colour = colours.get(r["state"], "yellow")
        duration = "" if r["seconds"] is None else f"{r['seconds']:.1f}s"
        table.add_row(r["stage"], f"[{colour}]{r['state']}[/{colour}]", duration, r["summary"])
    return table


@app.command()
def run(
    spec_path: SpecArg,
    backend: Annotated[str | None, typer.Option(help="Override compute.backend: local, sagemaker or batch.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Resume or name a run (default: a new id).")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Run the whole pipeline now, in this process, on Prefect's local API."""
    extra = _overrides(overrides)
    if backend:
        extra["compute.backend"] = backend
    spec = _load(spec_path, extra)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from flows.pipeline import PipelineFailed, pipeline
    from trnflow.errors import GateFailed

    state = pipeline(spec, run_id=run_id, return_state=True)
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, PipelineFailed):
        rows, code = outcome.stages, EXIT_GATE if isinstance(outcome.cause, GateFailed) else EXIT_FAILED
        payload = {"state": "Failed", "failed_stage": outcome.stage, "error": str(outcome.cause), "stages": rows}
    elif isinstance(outcome, BaseException):
        rows, code = [], EXIT_FAILED
        payload = {"state": "Failed", "error": f"{type(outcome).__name__}: {outcome}", "stages": rows}
    else:
        rows, code = outcome["stages"], 0
        payload = {"state": "Completed", "run_id": outcome["run_id"], "stages": rows,
                   "results": outcome["results"]}
    if as_json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        console.print(_summary_table(rows))
        if code:
            err.print(f"[red]pipeline failed: {payload['error']}[/red]")
        else:
            console.print(f"[green]pipeline completed[/green] (run {payload['run_id']})")
    raise typer.Exit(code)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
