"""`trnflow recipes`: the model recipes installed here, with their parameters and defaults."""

from __future__ import annotations

import json
from typing import Any

import typer
from pydantic_core import PydanticUndefined
from rich.markup import escape
from rich.table import Table

from trnflow.cli.common import JsonOpt, console, err
from trnflow.cli.console import RED
from trnflow.errors import ExitCode, FatalError


def _parameters(params: type) -> list[dict[str, Any]]:
    rows = []
    for name, field in params.model_fields.items():
        if field.default_factory is not None:
            default = field.default_factory()
        elif field.default is PydanticUndefined:
            default = "(required)"
        else:
            default = field.default
        rows.append({"name": name, "type": getattr(field.annotation, "__name__", str(field.annotation)),
                     "default": default, "description": field.description or ""})
    return rows


def recipes(as_json: JsonOpt = False) -> None:
    """List the installed model recipes (model.recipe in a spec), each with its parameters
    (model.params), their defaults, and the gate metrics it supports with which way each is better."""
    from trnflow.workload.recipes import installed, recipe_class  # recipes are models: torch (~1 s)

    found, broken = [], []
    for name, target in installed().items():
        try:
            cls = recipe_class(name)
        except FatalError as exc:
            broken.append({"name": name, "target": target, "error": str(exc)})
            continue
        found.append({"name": name, "version": cls.version, "target": target, "featurizer": cls.featurizer_file,
                      "embeds": cls.embeds, "params": _parameters(cls.Params),
                      "metrics": [{"name": m, "better": cls.direction(m)} for m in cls.metrics],
                      "about": (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")})
    if as_json:
        print(json.dumps({"recipes": found, "broken": broken}, indent=2, default=str))
    else:
        for recipe in found:
            table = Table("parameter", "type", "default", "description",
                          title=f"{recipe['name']} (version {recipe['version']}, {recipe['target']})",
                          caption="gate metrics: " + ", ".join(f"{m['name']} ({m['better']} is better)"
                                                               for m in recipe["metrics"]) + "; "
                                  f"{'embeddings' if recipe['embeds'] else 'predictions'} published; "
                                  f"featurizer {recipe['featurizer']}")
            for row in recipe["params"]:
                table.add_row(row["name"], row["type"], escape(json.dumps(row["default"], default=str)),
                              row["description"])
            console.print(table)
        for recipe in broken:
            err.print(f"{recipe['name']} ({recipe['target']}): {recipe['error']}", **RED)
    raise typer.Exit(ExitCode.FAILED if broken else ExitCode.OK)


def register(app: typer.Typer) -> None:
    app.command()(recipes)
