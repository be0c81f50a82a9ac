"""Loading job specs from YAML, with errors that name the file, the field and the fix."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from trnflow.specs.spec import JobSpec


class SpecError(ValueError):
    """A job spec that cannot be used. `problems` holds one `field.path: message` line per error."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid job spec\n" + "\n".join(f"  {p}" for p in problems))


# Our cross-field validators start their message with the field to fix: "train.steps: ...".
_OWN_PATH = re.compile(r"^([a-z_]+(?:\.[a-z0-9_]+)+): (.*)$", re.DOTALL)


def _field_path(loc: tuple[Any, ...]) -> str:
    """`train.init_from`, without pydantic's names for the branches of a union (`literal[...]`)."""
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and "[" in part)) or "(top level)"


def _describe(err: dict[str, Any]) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return "unknown field; remove it or check its spelling (`trnflow schema` lists every field)"
    if kind == "missing":
        return "required field is missing"
    # Errors raised by our own validators already say what to do; drop pydantic's prefix.
    return msg.removeprefix("Value error, ")


def _refuse_duplicate_keys(node: yaml.Node | None) -> None:
    """A key given twice in one mapping is an error (`yaml.safe_load` would keep the last)."""
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key.value!r} is given twice in the same section; keep one of them",
                        key.start_mark)
                seen.add(key.value)
            _refuse_duplicate_keys(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _refuse_duplicate_keys(item)


MODEL_CHECKS: list[Callable[[dict[str, Any]], list[str]]] = []
"""Checks of a spec's model section that need the recipe (registered by `trnflow.workload.recipes`
when it is imported): each takes the parsed spec and returns `field.path: message` lines."""


def validate_spec(data: Any, source: str = "<spec>") -> JobSpec:
    """Validate a parsed mapping into a JobSpec, or raise SpecError listing every problem (those of
    the recipe's params too, where a recipe check is registered)."""
    if not isinstance(data, dict):
        raise SpecError(source, [f"(top level): expected a mapping of sections, got {type(data).__name__}"])
    recipe_problems = [line for check in MODEL_CHECKS for line in check(data)]
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        problems: dict[str, str] = {}
        for err in exc.errors():
            message = _describe(err)
            own = _OWN_PATH.match(message)
            path, message = (own.group(1), own.group(2)) if own else (_field_path(err["loc"]), message)
            if err["type"] == "literal_error" and path in problems:
                continue  # a union's other branch (`champion` or a URL) said what is wrong already
            if path in problems and problems[path].startswith("Input should be"):
                problems[path] = message  # ...and the literal branch spoke first
            else:
                problems[path] = f"{problems[path]}; {message}" if path in problems else message
        raise SpecError(source, recipe_problems + [f"{path}: {message}" for path, message in problems.items()]
                        ) from None
    if recipe_problems:
        raise SpecError(source, recipe_problems)
    return spec


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None) -> JobSpec:
    """Read a YAML (or JSON) job spec file. `overrides` maps dotted field paths to values."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(str(path), ["(file): not found; check the path"]) from None
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), [f"(file): not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None
    except IsADirectoryError:
        raise SpecError(str(path), ["(file): is a folder, not a spec file; give the path of a .yaml spec"]) from None
    except OSError as exc:
        raise SpecError(str(path), [f"(file): cannot be read ({exc.strerror}); check the path and its "
                                    "permissions"]) from None
    return parse_spec(text, str(path), overrides)


def parse_spec(text: str, source: str, overrides: dict[str, Any] | None = None) -> JobSpec:
    """A job spec from YAML (or JSON) text read from `source`, which error messages name."""
    try:
        _refuse_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))  # nodes only: nothing is built
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(source, [f"{where}: malformed YAML: {problem}"]) from None
    if overrides:
        data = apply_overrides(data if isinstance(data, dict) else {}, overrides)
    return validate_spec(data, source)


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted path (`train.steps`) set to its value."""
    out = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for dotted, value in overrides.items():
        node = out
        *parents, leaf = dotted.split(".")
        for key in parents:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[leaf] = value
    return out
