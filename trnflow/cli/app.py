"""The `trnflow` command: validate specs, inspect the emulated devices, make data, run the pipeline.

This is the composition root: it reads specs and settings, picks what to run and prints results.
Prefect is imported only by the commands that run flows, so the others start fast.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from trnflow.cli import render
from trnflow.cli import runs as cli_runs
from trnflow.cli import serve as cli_serve
from trnflow.cli.cache import cache_app
from trnflow.cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_GATE,
    JsonOpt,
    SetOpt,
    SpecArg,
    check_instance_type,
    console,
    err,
    load,
    set_overrides,
    unknown_instance_type,
)
from trnflow.cli.models import models_app
from trnflow.cli.render import RED
from trnflow.specs import CATALOGUE, JobSpec, SpecError, load_spec

app = typer.Typer(
    name="trnflow",
    help="Production training pipelines for AWS Trainium, with a local NeuronCore emulator.",
    no_args_is_help=True,
    add_completion=False,
)
data_app = typer.Typer(help="Make and inspect datasets.", no_args_is_help=True)
app.add_typer(data_app, name="data")
app.add_typer(cache_app, name="cache")
app.add_typer(models_app, name="models")


@app.command("mock-aws")
def mock_aws_command(port: int = typer.Option(5000, help="Port on 127.0.0.1."),
                     seed_data: bool = typer.Option(True, help="Upload the quickstart's synthetic dataset.")) -> None:
    """Run SageMaker, Batch, S3 and CloudWatch on 127.0.0.1 (moto), with submitted jobs run for real."""
    try:  # the mocked cloud is test machinery: it comes with the [mock] extra (moto), not with trnflow
        from trnflow.testing.aws_server import mock_aws
    except ModuleNotFoundError as exc:
        err.print(f"trnflow mock-aws needs {exc.name}, which comes with the mock extra: "
                  "pip install 'trnflow[mock]' (or 'trnflow[dev]' in a checkout)", **RED)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    mock_aws(port=port, seed_data=seed_data)

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
                console.print(f"[green]ok[/green] {escape(item['file'])} ({item['name']})")
            else:
                err.print(f"[red]invalid[/red] {escape(item['file'])}")
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
    """List the emulated instance's Neuron devices and which process holds each core, like `neuron-ls`."""
    from trnflow.emulator.cores import holders
    from trnflow.neuron.topology import core_owners, neuron_ls

    check_instance_type(instance_type)
    records = neuron_ls(instance_type, core_owners(instance_type, holders(CATALOGUE[instance_type].cores)))
    if as_json:
        print(json.dumps(records, indent=2))
        return
    t = CATALOGUE[instance_type]
    console.print(f"instance-type: {instance_type}  ({t.cores} NeuronCores, {t.chips} device(s))")
    table = Table("NEURON DEVICE", "NEURON CORES", "NEURON CORE IDS", "NEURON MEMORY", "CONNECTED DEVICES", "BDF",
                  "PID", "COMMAND")
    for r in records:
        ids = r["neuroncore_ids"]
        procs = r["neuron_processes"]
        table.add_row(str(r["neuron_device"]), str(r["nc_count"]), f"{ids[0]}-{ids[-1]}",
                      f"{r['memory_size'] // 1024**3} GB", ", ".join(map(str, r["connected_to"])), r["bdf"],
                      "\n".join(str(p["pid"]) for p in procs), "\n".join(p["command"] for p in procs))
    console.print(table)


@app.command()
def top(
    instance_type: Annotated[str, typer.Option(help="Instance type to emulate.")] = "trn1.2xlarge",
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    as_json: JsonOpt = False,
):
    """A live view of each emulated NeuronCore: owner, utilisation and memory held, like neuron-top."""
    from rich.live import Live

    from trnflow.emulator.monitor import CoreMonitor

    check_instance_type(instance_type)
    monitor = CoreMonitor(instance_type)
    if once or as_json:
        snapshot = monitor.sample(interval)
        if as_json:
            print(json.dumps(snapshot, indent=2))
        else:
            console.print(render.top_table(instance_type, snapshot))
        return
    try:
        with Live(render.top_table(instance_type, monitor.sample(0.1)), console=console, screen=False) as live:
            while True:
                live.update(render.top_table(instance_type, monitor.sample(interval)))
    except KeyboardInterrupt:
        pass


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
    import datetime as dt

    from trnflow.workload.synth import synthesize

    try:
        first = dt.date.fromisoformat(start)
    except ValueError:
        err.print(f"--start {start!r}: expected a date, YYYY-MM-DD", **RED)
        raise typer.Exit(EXIT_BAD_INPUT) from None

    if fmt not in ("jsonl", "parquet", "csv", "amazon-polarity"):
        err.print(f"--format {fmt!r}: choose jsonl, parquet, csv or amazon-polarity", **RED)
        raise typer.Exit(EXIT_BAD_INPUT)
    if out.exists() and not out.is_dir():
        err.print(f"OUT {out} is a file; give a folder (it will hold train/, holdout/ and inference/)", **RED)
        raise typer.Exit(EXIT_BAD_INPUT)
    summary = synthesize(out, days, rows_per_day, seed, fmt, holdout_rows, inference_rows, start=first,
                         train_only=train_only)
    console.print(f"wrote {summary['train_rows']} training rows in {summary['train_partitions']} partition(s), "
                  f"{summary['holdout_rows']} holdout and {summary['inference_rows']} inference rows to {out}")


@app.command()
def reference(spec_path: SpecArg, overrides: SetOpt = None):
    """Train the spec in plain fp32 (as a GPU run would) and write its metrics to gate.reference."""
    from trnflow.errors import TrnflowError
    from trnflow.lifecycle.reference import run_reference

    spec = load(spec_path, set_overrides(overrides))
    try:
        with console.status("training the fp32 reference"):
            document = run_reference(spec)
    except TrnflowError as exc:
        err.print(f"{exc}", **RED)
        raise typer.Exit(EXIT_FAILED) from None
    final = document["points"][-1]
    console.print(f"reference written to {spec.gate.reference}: step {final['step']}, "
                  f"accuracy {final['accuracy']:.4f}")


@app.command("compile")
def compile_cmd(
    spec_path: SpecArg,
    check: Annotated[bool, typer.Option("--check", help="Only say which graphs would hit or miss; compile nothing.")
                     ] = False,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Compile entries that failed before.")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Compile the spec's programs ahead of time into the persistent cache (like neuron_parallel_compile)."""
    import re

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from trnflow.backends import JobRequest, JobState, backend_for, run_to_end
    from trnflow.errors import TrnflowError
    from trnflow.settings import TrnflowSettings

    spec = load(spec_path, set_overrides(overrides))
    settings = TrnflowSettings()
    options = {"check": check, "retry_failed": retry_failed}
    counts = re.compile(r"remaining items are \d+, locked are (\d+), failed are (\d+), done are (\d+), "
                        r"total is (\d+)")
    columns = (TextColumn("compiling"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, disable=as_json) as progress:
        bar = progress.add_task("extracting graphs", total=None)

        def follow(text: str) -> None:
            for match in counts.finditer(text):
                locked, failed, done, total = map(int, match.groups())
                progress.update(bar, total=total, completed=done + failed,
                                description=f"locked {locked}, failed {failed}")

        try:
            backend = backend_for(spec, settings)
            request = JobRequest(spec, "compile", "compile", processes=1, options=options)
            _, info = run_to_end(backend, request, settings.poll_seconds, on_logs=follow)
        except TrnflowError as exc:
            err.print(f"{exc}", **RED)
            raise typer.Exit(EXIT_FAILED) from None
    if info.state is not JobState.SUCCEEDED or info.result is None:
        failure = info.failure or {}
        if as_json:
            print(json.dumps({"state": "Failed", "error": failure.get("message")}))
        err.print(f"{failure.get('type', 'failed')}: {failure.get('message', '')}", **RED)
        raise typer.Exit(EXIT_FAILED)
    result = info.result
    if as_json:
        print(json.dumps(result, indent=2))
        return
    table = Table("program", "input shapes", "key", "state", "outcome", title=f"compile cache {result['cache']}")
    report = result.get("report", {})
    for row in result["programs"]:
        done = report.get(row["key"], {})
        outcome = row["will"] if check else f"{done.get('status', '?')} ({done.get('seconds', 0):.1f}s)"
        table.add_row(row["program"], row.get("shapes", ""), row["key"], row["state"], outcome)
    console.print(table)
    if check:
        console.print(f"{result['hits']} hit(s), {result['misses']} miss(es)")


def _check_run_id(run_id: str | None) -> None:
    """Refuse a run id that could not name a checkpoint folder, before anything starts."""
    if run_id is not None and (not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", run_id) or run_id in (".", "..")):
        err.print(f"--run-id {run_id!r}: use letters, digits, '.', '_' and '-' only (at most 128)", **RED)
        raise typer.Exit(EXIT_BAD_INPUT)


def _check_data(spec: JobSpec) -> None:
    """Refuse local data folders that are missing or hold no files of `data.format` before the
    pipeline starts (S3 data is listed by the stages that read it)."""
    from trnflow.errors import DataError
    from trnflow.storage.datafiles import data_files

    for field in ("train", "holdout", "inference"):
        url = getattr(spec.data, field)
        if url and url.startswith("file://"):
            try:
                data_files(url, spec.data.format)
            except DataError as exc:
                err.print(f"data.{field}: {exc}", **RED)
                raise typer.Exit(EXIT_BAD_INPUT) from None


def _run_flow(flow_fn, stages: tuple[str, ...], title: str, spec: JobSpec, run_id: str | None, as_json: bool,
              show=None) -> None:
    """Run a flow in-process on Prefect's local API; print its stage table; exit with its outcome."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from trnflow.cli.progress import training_progress
    from trnflow.errors import GateFailed
    from trnflow.flows._stages import PipelineFailed

    with training_progress(err, enabled=not as_json and err.is_terminal):
        state = flow_fn(spec, run_id=run_id, return_state=True)
    outcome = state.result(raise_on_failure=False)
    if isinstance(outcome, PipelineFailed):
        rows, code = outcome.stages, EXIT_GATE if isinstance(outcome.cause, GateFailed) else EXIT_FAILED
        payload = {"state": "Failed", "failed_stage": outcome.stage, "error": str(outcome.cause), "stages": rows}
    elif isinstance(outcome, BaseException):
        rows, code = [], EXIT_FAILED
        payload = {"state": "Failed", "error": f"{type(outcome).__name__}: {outcome}", "stages": rows}
    elif outcome.get("nothing_new"):  # scheduled retraining with no new data: no job was launched
        payload = {"state": "Completed", "nothing_new": True, "message": state.message, "stages": []}
        if as_json:
            print(json.dumps(payload, indent=2))
        else:
            console.print(f"[cyan]{title}: {state.message}[/cyan]")
        raise typer.Exit(0)
    else:
        rows, code = outcome["stages"], 0
        payload = {"state": "Completed", "run_id": outcome["run_id"], "stages": rows, "results": outcome["results"],
                   "cost": outcome.get("cost")}
    if as_json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        if show and code == 0:
            show(outcome["results"])
        console.print(render.stage_table(rows, stages, title))
        if code == 0 and (outcome.get("cost") or {}).get("rows"):
            console.print(render.cost_table(outcome["cost"]))
        if code:
            err.print(f"{title} failed: {payload['error']}", **RED)
        else:
            console.print(f"[green]{title} completed[/green] (run {payload['run_id']})")
    raise typer.Exit(code)


@app.command()
def run(
    spec_path: SpecArg,
    backend: Annotated[str | None, typer.Option(help="Override compute.backend: local, sagemaker or batch.")] = None,
    run_id: Annotated[str | None, typer.Option(help="Resume or name a run (default: a new id).")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Run the whole pipeline now, in this process, on Prefect's local API."""
    extra = set_overrides(overrides)
    if backend:
        extra["compute.backend"] = backend
    _check_run_id(run_id)
    spec = load(spec_path, extra)
    _check_data(spec)
    from trnflow.flows.pipeline import STAGES, pipeline

    _run_flow(pipeline, STAGES, "trnflow pipeline", spec, run_id, as_json)


@app.command()
def retrain(
    spec_path: SpecArg,
    run_id: Annotated[str | None, typer.Option(help="Resume or name a run (default: a new id).")] = None,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
):
    """Retrain the champion on the data after its watermark now, in this process (as the schedule does)."""
    _check_run_id(run_id)
    spec = load(spec_path, set_overrides(overrides))
    if spec.registry_url is None:
        err.print(f"{spec_path}: registry_url: retraining keeps its champion and watermark in a model "
                  "registry; set registry_url", **RED)
        raise typer.Exit(EXIT_BAD_INPUT)
    from trnflow.flows.incremental_retrain import STAGES, incremental_retrain

    _run_flow(incremental_retrain, STAGES, "trnflow retrain", spec, run_id, as_json)


@app.command()
def preflight(spec_path: SpecArg, overrides: SetOpt = None, as_json: JsonOpt = False):
    """Sanity-check every engine of each core the spec uses, then the collectives between them."""
    spec = load(spec_path, set_overrides(overrides))
    from trnflow.flows.preflight import STAGES
    from trnflow.flows.preflight import preflight as preflight_flow

    def show(results: dict) -> None:
        console.print(render.sanity_table(results["sanity"]["per_core"]))
        mem = results["sanity"].get("memory")
        if mem:
            console.print(f"device memory per core: {mem['total'] / 1024**3:.2f} GiB estimated of "
                          f"{mem['per_core_limit'] / 1024**3:.1f} GiB ({mem['parameters']:,} parameters)")
        if results["collectives"]["rows"]:
            print(render.nccom_text(results["collectives"]["rows"]))

    _run_flow(preflight_flow, STAGES, "trnflow preflight", spec, None, as_json, show)


@app.command()
def collectives(
    cores: Annotated[int, typer.Option("--cores", "-r", min=2, help="Ranks (emulated NeuronCores).")] = 2,
    op: Annotated[str, typer.Option(help="all_reduce, all_gather, reduce_scatter, all_to_all or all.")] = "all_reduce",
    minbytes: Annotated[str, typer.Option("--minbytes", "-b", help="Smallest size (65536, 64KB, 1MB).")] = "64KB",
    maxbytes: Annotated[str, typer.Option("--maxbytes", "-e", help="Largest size.")] = "4MB",
    stepfactor: Annotated[int, typer.Option("--stepfactor", "-f", min=1, help="Size multiplier per step.")] = 4,
    iters: Annotated[int, typer.Option("--iters", "-n", min=1, help="Timed iterations per size.")] = 5,
    dtype: Annotated[str, typer.Option("--datatype", "-d", help="fp32 or bf16.")] = "fp32",
    check: Annotated[bool, typer.Option("--check", "-c", help="Check every result.")] = False,
    instance_type: Annotated[str, typer.Option(help="Instance to emulate.")] = "trn1.32xlarge",
    timeout: Annotated[float, typer.Option(help="Seconds before a stuck collective is reported hung.")] = 60.0,
    as_json: JsonOpt = False,
):
    """Collective tests like nccom-test: a size sweep with algbw/busbw per op, optionally checked."""
    from trnflow.backends import JobRequest, JobState, run_to_end
    from trnflow.backends.local import LocalBackend
    from trnflow.settings import TrnflowSettings
    from trnflow.workload.collectives import OPS

    ops = list(OPS) if op == "all" else [op]
    problems = [f"--op {o!r}: choose one of {', '.join(OPS)} or all" for o in ops if o not in OPS]
    if dtype not in ("fp32", "bf16"):
        problems.append(f"--datatype {dtype!r}: choose fp32 or bf16")
    if instance_type not in CATALOGUE:
        problems.append(unknown_instance_type(instance_type))
    try:
        lo, hi = render.parse_size(minbytes), render.parse_size(maxbytes)
    except ValueError as exc:
        problems.append(str(exc))
        lo = hi = 0
    if lo > hi:
        problems.append(f"--minbytes {minbytes} is larger than --maxbytes {maxbytes}")
    if problems:
        for p in problems:
            err.print(f"{p}", **RED)
        raise typer.Exit(EXIT_BAD_INPUT)
    settings = TrnflowSettings()
    backend = LocalBackend(settings.jobs_dir)
    options = {"ops": ops, "minbytes": lo, "maxbytes": hi, "stepfactor": stepfactor, "iters": iters,
               "dtype": dtype, "check": check, "timeout_seconds": timeout}
    request = JobRequest(None, "collectives", "collectives", processes=cores, options=options,
                         instance_type=instance_type)
    from trnflow.errors import TrnflowError

    try:
        with console.status(f"collectives on {cores} cores"):
            _, info = run_to_end(backend, request, settings.poll_seconds)
    except TrnflowError as exc:
        err.print(f"{exc}", **RED)
        raise typer.Exit(EXIT_FAILED) from None
    if info.state is not JobState.SUCCEEDED or info.result is None:
        failure = info.failure or {}
        err.print(f"{failure.get('type', 'failed')}: {failure.get('message', '')}", **RED)
        if as_json:
            print(json.dumps({"results": [], "error": failure.get("message")}))
        raise typer.Exit(EXIT_FAILED)
    rows = info.result["rows"]
    if as_json:
        print(json.dumps({"results": rows, "avg_busbw": info.result["avg_busbw"], "cores": info.details["cores"]},
                         indent=2))
    else:
        print(render.nccom_text(rows))


cli_serve.register(app)  # deployments of every flow
cli_runs.register(app)  # runs on a Prefect server: submit, runs, status, logs, cancel


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
