"""What every command group shares: the consoles, the options they all take, and reading a spec."""

from __future__ import annotations

import ipaddress
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from trnflow.cli.args import assignments
from trnflow.cli.console import RED, cli_console
from trnflow.errors import ExitCode
from trnflow.neuron.devices import problems as device_problems
from trnflow.specs import CATALOGUE, JobSpec, SpecError, load_spec

console = cli_console()
err = cli_console(stderr=True)


SpecArg = Annotated[Path, typer.Argument(help="Job spec YAML file.", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a spec field: --set train.steps=50 (repeatable; value parsed as YAML)."),
]


def set_overrides(pairs: list[str] | None) -> dict[str, Any]:
    return assignments(pairs, "--set", "train.steps=50", name="FIELD")


def unknown_instance_type(name: str) -> str:
    return f"--instance-type {name!r} is unknown; choose one of: {', '.join(CATALOGUE)}"


def check_instance_type(name: str) -> None:
    if name not in CATALOGUE:
        err.print(f"{unknown_instance_type(name)}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)


def checked(path: Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """The spec at `path`, valid in itself and runnable from here: its recipe is installed and takes
    its params (`trnflow.workload.recipes.problems`), and a local job's device has its SDK in this
    environment (`trnflow.neuron.devices.problems`)."""
    from trnflow.workload.recipes import RECIPES  # recipes are models: torch (~1 s)

    spec = load_spec(path, overrides, RECIPES)
    found = device_problems(spec, local=spec.compute.backend == "local")
    if found:
        raise SpecError(str(path), found)
    return spec


def load(path: Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    try:
        return checked(path, overrides)
    except SpecError as exc:
        err.print(f"{exc.source}: invalid job spec", **RED)
        for problem in exc.problems:
            err.print(f"  {problem}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(ExitCode.BAD_INPUT) from None


def loopback_only(host: str, what: str, elsewhere: str) -> None:
    """Exit 2 unless `host` is a loopback address: a local server with no auth of its own (`what`)
    listens on this machine only; `elsewhere` says how to reach one from other machines."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        err.print(f"--host {host}: {what} has no auth, so it listens on loopback only (127.0.0.1, ::1); {elsewhere}",
                  **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)


def installed_command(name: str, fix: str) -> Path:
    """The `name` command installed beside this Python (else on PATH); exit 2 saying `fix` when
    there is none."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return beside
    found = shutil.which(name)
    if found is None:
        err.print(f"the `{name}` command is not installed beside trnflow; {fix}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    return Path(found)
