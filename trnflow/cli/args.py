"""`NAME=VALUE` command-line options (`--set`, `--param`), their values read as YAML."""

from __future__ import annotations

from typing import Any

import typer
import yaml

from trnflow.cli.console import RED, cli_console
from trnflow.errors import ExitCode


def assignments(pairs: list[str] | None, option: str, example: str, name: str = "NAME") -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> `{"a.b": 1, "c": "x"}`; a malformed pair is one red line and exit 2."""

    err = cli_console(stderr=True)
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            err.print(f"{option} {pair!r}: expected {name}=VALUE, for example {option} {example}", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            err.print(f"{option} {pair!r}: the value is not valid YAML ({getattr(exc, 'problem', exc)}); quote it, "
                      f"for example {option} '{key}=\"{value}\"'", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT) from None
    return out
