"""The job-spec reference, docs/spec-reference.md, rendered from the pydantic models of `JobSpec`.

Every section and field, with its type, allowed values, default and description, comes from the
models in `jobspecs/spec.py`, so the page cannot drift from the code. Regenerate it after changing
a field:

    python -m trnflow.specs.reference > docs/spec-reference.md
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from trnflow.specs.spec import JobSpec

COMMAND = "python -m trnflow.specs.reference > docs/spec-reference.md"
"""How docs/spec-reference.md is made."""

_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}


def _is_url(metadata: typing.Iterable[Any]) -> bool:
    """Whether a field's validators include the URL normaliser (`Url` in spec.py)."""
    return any(getattr(getattr(m, "func", None), "__name__", "") == "normalise_url" for m in metadata)


def _section_models(annotation: Any) -> list[type[BaseModel]]:
    """The spec sections (pydantic models) an annotation refers to, directly or inside list/Optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _section_models(arg)]


def _type(annotation: Any, metadata: typing.Sequence[Any] = ()) -> str:
    """A reader's name for a field's type: `integer`, `URL`, "one of `a`, `b`", "list of ...", "... or null"."""
    if _is_url(metadata):
        return "URL"
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0], args[1:])
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        text = " or ".join(_type(a) for a in present)
        return f"{text} or null" if len(present) < len(args) else text
    if origin is Literal:
        values = [f"`{_value(v)}`" for v in args]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    if origin is list:
        inner = _type(args[0])
        if inner.startswith("one of"):
            return f"list, each {inner}"
        return f"list of {inner}s" if args[0] in _SCALARS else f"list of {inner}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not any(annotation in _section_models(i.annotation) for i in JobSpec.model_fields.values()):
            return "the fields below"  # a section within a section: its fields are rows of their own
        return f"[{_section_name(annotation)}](#{_section_name(annotation)})"
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _rows(prefix: str, model: type[BaseModel]) -> list[tuple[str, FieldInfo]]:
    """A section's fields by path; a section within it (`train.parallelism`) by its own fields'."""
    rows = []
    for field, info in model.model_fields.items():
        inner = _section_models(info.annotation)
        if len(inner) == 1 and typing.get_origin(info.annotation) is not list:  # a section, or an optional one
            rows += [(f"{prefix}.{field}", info), *_rows(f"{prefix}.{field}", inner[0])]
        else:
            rows.append((f"{prefix}.{field}", info))
    return rows


def _section_name(model: type[BaseModel]) -> str:
    """The top-level field a section model is found under (`TrainSpec` -> `train`)."""
    for name, info in JobSpec.model_fields.items():
        if model in _section_models(info.annotation):
            return name
    raise KeyError(f"{model.__name__} is not a section of JobSpec")


def _constraints(info: FieldInfo) -> str:
    """Bounds and patterns from the field's metadata: `>= 1, <= 10`, `matches ^[a-z]+$`."""
    out = []
    for item in info.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            bound = getattr(item, attr, None)
            if bound is not None:
                out.append(f"{sign} {_value(bound)}")
        pattern = getattr(item, "pattern", None)
        if pattern:
            out.append(f"matches `{pattern}`")
    return ", ".join(out)


def _value(value: Any) -> str:
    """A value as it is written in a YAML spec."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        shown = getattr(info.default_factory, "shown", None)
        if shown:  # a default that depends on the machine, in words
            return f"`{shown}`"
        made = info.default_factory()  # type: ignore[call-arg]
        if isinstance(made, BaseModel):
            return "its fields' defaults"
        return f"`{_value(made)}`"
    if info.default is PydanticUndefined:
        return "required"
    return f"`{_value(info.default)}`"


def _cell(text: str) -> str:
    """Text that stays inside one Markdown table cell."""
    text = " ".join(text.split()).replace("|", "\\|")
    return re.sub(r"<(?=[A-Za-z/!])", "&lt;", text)  # `<file>` would be read as an HTML tag


def _table(rows: list[tuple[str, FieldInfo]]) -> list[str]:
    lines = ["| field | type | default | description |", "|---|---|---|---|"]
    for path, info in rows:
        kind = _type(info.annotation, info.metadata)
        limits = _constraints(info)
        if limits:
            kind = f"{kind}, {limits}"
        lines.append(f"| `{path}` | {_cell(kind)} | {_cell(_default(info))} | {_cell(info.description or '')} |")
    return lines


def markdown() -> str:
    """docs/spec-reference.md: the top level of a job spec, then each section's fields."""
    lines = [
        "# Job spec reference",
        "",
        f"<!-- Generated from jobspecs/spec.py by `{COMMAND}`; edit the models, not this page. -->",
        "",
        _cell(inspect.getdoc(JobSpec) or ""),
        "",
        "A spec is a YAML file. Unknown fields are errors, and `trnflow validate SPEC` lists every problem as",
        "`field.path: message`. `trnflow schema` prints the same models as a JSON Schema, for editor completion.",
        "Fields marked *required* have no default. A URL is an `s3://` URL, a `file://` URL or a path; a",
        "relative path is resolved against the directory trnflow runs in. Beyond the bounds below, fields are",
        "checked against each other (the batch must divide across the cores, the cores must fit the",
        "instance type, `champion` needs `registry_url`), and those messages name the fix.",
        "",
        "## Top level",
        "",
        *_table(list(JobSpec.model_fields.items())),
    ]
    for name, info in JobSpec.model_fields.items():
        for model in _section_models(info.annotation):
            prefix = f"{name}[]" if typing.get_origin(info.annotation) is list else name
            lines += ["", f"## {name}", "", _cell(inspect.getdoc(model) or ""), ""]
            if prefix != name:
                lines += [f"`{name}` is a list; each item has these fields.", ""]
            lines += _table(_rows(prefix, model))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
