"""`trnflow devices`, `top` and `collectives`: the emulated instance's NeuronCores, like the Neuron
SDK's neuron-ls, neuron-top and nccom-test."""

from __future__ import annotations

import hashlib
import json
import socket
from typing import Annotated

import typer
from rich.live import Live

from trnflow.backends import JobRequest, JobState, run_to_end
from trnflow.cli import render
from trnflow.cli.common import JsonOpt, check_instance_type, console, err, unknown_instance_type
from trnflow.cli.console import RED
from trnflow.emulator.cores import holders
from trnflow.emulator.monitor import CoreMonitor
from trnflow.errors import ExitCode, TrnflowError
from trnflow.neuron.nccom import OPS
from trnflow.neuron.topology import core_owners, neuron_ls
from trnflow.results import CollectivesResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import CATALOGUE


def devices(
    instance_type: Annotated[str, typer.Option(help="Instance type to emulate.")] = "trn1.2xlarge",
    as_json: JsonOpt = False,
):
    """List the emulated instance's Neuron devices and which process holds each core, like `neuron-ls`."""

    check_instance_type(instance_type)
    t = CATALOGUE[instance_type]
    records = neuron_ls(instance_type, core_owners(instance_type, holders(t.cores)))
    if as_json:
        print(json.dumps(records, indent=2))
        return
    for line in render.neuron_ls_header(instance_type, emulated_instance_id(), records):
        console.print(line, markup=False, highlight=False)
    console.print(render.neuron_ls_table(records))


def emulated_instance_id() -> str:
    """neuron-ls's `instance-id:` line reads the instance metadata; an emulated host has none, so
    an id in EC2's form made from the host name, the same on every call."""
    return "i-" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:17]


def top(
    instance_type: Annotated[str, typer.Option(help="Instance type to emulate.")] = "trn1.2xlarge",
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    as_json: JsonOpt = False,
):
    """A live view of each emulated NeuronCore: owner, utilisation and memory held, like neuron-top."""

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
    from trnflow.backends.local import LocalBackend  # heavy: torch (the local backend starts torchrun)

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
        raise typer.Exit(ExitCode.BAD_INPUT)
    settings = TrnflowSettings()
    backend = LocalBackend(settings.jobs_dir)
    options = {"ops": ops, "minbytes": lo, "maxbytes": hi, "stepfactor": stepfactor, "iters": iters,
               "dtype": dtype, "check": check, "timeout_seconds": timeout}
    request = JobRequest(None, "collectives", "collectives", processes=cores, options=options,
                         instance_type=instance_type)
    try:
        with console.status(f"collectives on {cores} cores"):
            _, info = run_to_end(backend, request, settings.poll_seconds)
    except TrnflowError as exc:
        err.print(f"{exc}", **RED)
        raise typer.Exit(ExitCode.FAILED) from None
    if info.state is not JobState.SUCCEEDED or info.result is None:
        err.print(info.failed(), **RED)
        if as_json:
            print(json.dumps({"results": [], "error": info.failure.message if info.failure else info.failed()}))
        raise typer.Exit(ExitCode.FAILED)
    result = info.result
    assert isinstance(result, CollectivesResult)
    if as_json:
        print(json.dumps({"results": [r.model_dump(mode="json") for r in result.rows], "avg_busbw": result.avg_busbw,
                          "cores": info.details.cores,
                          "plans": [p.model_dump() for p in result.plans]}, indent=2))
    else:
        print(render.nccom_text(result.rows))


def register(app: typer.Typer) -> None:
    for command in (devices, top, collectives):
        app.command()(command)
