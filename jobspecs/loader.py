"""Loading job specs from YAML, with errors that name the file, the field and the fix."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Protocol

import yaml
from pydantic import ValidationError

from trnflow.specs.spec import JobSpec

MAX_PROBLEMS = 50
"""Problems listed per spec. A spec with thousands (a list of bad entries) is fixed from its first
few, and listing them all takes longer than finding them."""


class SpecError(ValueError):
    """A job spec that cannot be used. `problems` holds one `field.path: message` line per error,
    the first MAX_PROBLEMS of them and a line saying how many more there are."""

    def __init__(self, source: str, problems: list[str]):
        if len(problems) > MAX_PROBLEMS:
            more = len(problems) - MAX_PROBLEMS
            problems = [*problems[:MAX_PROBLEMS], f"(and {more:,} more): not listed; fix these and validate again"]
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: invalid job spec\n" + "\n".join(f"  {p}" for p in problems))


# Our cross-field validators start their message with the field to fix: "train.steps: ...".
_OWN_PATH = re.compile(r"^([a-z_]+(?:\.[a-z0-9_]+)+): (.*)$", re.DOTALL)


def _field_path(loc: tuple[Any, ...]) -> str:
    """`train.init_from`, without pydantic's names for the branches of a union (`literal[...]`)."""
    return ".".join(str(part) for part in loc if not (isinstance(part, str) and "[" in part)) or "(top level)"


_PATTERN_HINTS = {
    r"^[a-z0-9][a-z0-9-]{0,62}$": "use lower-case letters, digits and dashes, starting with a letter or digit, "
                                  "at most 63 characters (for example {example!r})",
    r"^[A-Za-z0-9._-]+$": "use a plain file name: letters, digits, '.', '_' and '-' (for example '_SUCCESS')",
    r"^[A-Za-z0-9_]{1,255}$": "use letters, digits and '_' only, at most 255 characters (for example 'team_a')",
}
"""What to write instead, for each `pattern` a spec field has (their JSON-schema form is no help)."""


def _pattern_problem(err: dict[str, Any]) -> str:
    pattern = err.get("ctx", {}).get("pattern", "")
    given = err.get("input")
    example = re.sub(r"[^a-z0-9-]+", "-", str(given).lower()).strip("-")[:63] or "my-job"
    hint = _PATTERN_HINTS.get(pattern)
    if hint is None:
        return f"{given!r} does not match {pattern!r}"
    return f"{given!r} is not allowed here; " + hint.format(example=example)


def _describe(err: dict[str, Any]) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        return "unknown field; remove it or check its spelling (`trnflow schema` lists every field)"
    if kind == "missing":
        return "required field is missing"
    if kind == "string_pattern_mismatch":
        return _pattern_problem(err)
    # Errors raised by our own validators already say what to do; drop pydantic's prefix.
    return msg.removeprefix("Value error, ")


MAX_SPEC_BYTES = 1024 * 1024
"""A job spec names its data, it never holds it: 1 MiB is far more than any spec needs, and
refusing larger input before it is parsed bounds what a bad file can cost (a 50 MB value took
half a minute to parse and check)."""

MAX_SPEC_VALUES = 20_000
"""How many values (scalars, lists and mappings) a spec may hold, counting an alias's each time
it is used. A spec has a few hundred; the bound stops a document before it is built, however it
was written: a few hundred bytes of nested aliases ("billion laughs") stand for billions of
values, which every walk over the parsed data would expand."""

MAX_SPEC_DEPTH = 64
"""How deeply a spec's values may nest (a spec has about four levels)."""

_CParser: type | None = getattr(getattr(yaml, "cyaml", None), "CParser", None)
"""libyaml's parser, where PyYAML was built with it (`yaml.__with_libyaml__`): many times faster."""
_PARSERS: tuple[type, ...] = (_CParser,) if _CParser else (yaml.reader.Reader, yaml.scanner.Scanner,
                                                          yaml.parser.Parser)


class _Refused(Exception):
    """A YAML document refused while it is composed, before any Python data is built."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


class _BoundedComposer(yaml.composer.Composer):
    """PyYAML's composer, counting values as it goes: more than MAX_SPEC_VALUES (aliases counted
    as often as they are used), nesting deeper than MAX_SPEC_DEPTH, an alias inside its own
    anchor and a key given twice in one mapping are refused. Aliases still share their node, so
    the cost is the file's, never the expansion's."""

    def __init__(self) -> None:
        super().__init__()
        self.values = 0
        self.via_aliases = 0  # of those, the values aliases repeat
        self.depth = 0
        self.duplicates: list[tuple[int, int, str]] = []  # (line, column, problem)
        self.sizes: dict[int, int] = {}  # id(anchored node) -> values it holds, aliases expanded

    def _add(self, count: int, mark: Any, alias: bool = False) -> None:
        self.values += count
        self.via_aliases += count if alias else 0
        if self.values > MAX_SPEC_VALUES:
            if self.via_aliases > self.values // 2:
                raise _Refused(f"{_at(mark)}: its aliases (*name) expand the spec to more than {MAX_SPEC_VALUES:,} "
                               "values; alias expansion refused (a \"billion laughs\" document?): write the values "
                               "out, or alias fewer of them")
            raise _Refused(f"{_at(mark)}: the spec holds more than {MAX_SPEC_VALUES:,} values; a job spec has a "
                           "few hundred and names its data (data.train, ...) rather than holding it")

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)  # the anchored node; an undefined one is an error
            if id(node) not in self.sizes:
                raise _Refused(f"{_at(mark)}: an alias inside the value it names (a recursive alias); a job spec "
                               "is a tree: write the value out")
            self._add(self.sizes[id(node)], mark, alias=True)
            return node
        event = self.peek_event()
        self.depth += 1
        if self.depth > MAX_SPEC_DEPTH:
            raise _Refused(f"{_at(event.start_mark)}: values nested more than {MAX_SPEC_DEPTH} levels deep; a job "
                           "spec has a few levels")
        self._add(1, event.start_mark)
        before = self.values
        node = super().compose_node(parent, index)
        self.depth -= 1
        if event.anchor is not None:
            self.sizes[id(node)] = self.values - before + 1
        return node

    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:
        """A key given twice in one mapping is an error (`yaml.safe_load` would keep the last)."""
        node = super().compose_mapping_node(anchor)
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    self.duplicates.append((key.start_mark.line, key.start_mark.column,
                                            f"{_at(key.start_mark)}: {key.value!r} is given twice in the same "
                                            "section; keep one of them"))
                seen.add(key.value)
        return node


class _SpecLoader(_BoundedComposer, *_PARSERS, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
    """`yaml.safe_load`'s loader (libyaml's parser where installed, the same safe constructor: no
    Python objects), with the bounded composer."""

    def __init__(self, text: str):
        if _CParser:
            _CParser.__init__(self, text)
        else:  # pragma: no cover - PyYAML without libyaml
            yaml.reader.Reader.__init__(self, text)
            yaml.scanner.Scanner.__init__(self)
            yaml.parser.Parser.__init__(self)
        _BoundedComposer.__init__(self)
        yaml.constructor.SafeConstructor.__init__(self)
        yaml.resolver.Resolver.__init__(self)


def _size_problem(size: int) -> str | None:
    if size <= MAX_SPEC_BYTES:
        return None
    return (f"(file): is {size:,} bytes, more than the {MAX_SPEC_BYTES:,} (1 MiB) a job spec may have; a spec "
            "names its data (data.train, ...) rather than holding it: check that this is the spec file")


def _read_yaml(text: str, source: str) -> Any:
    """The data of one YAML document, as `yaml.safe_load` gives it, parsed once and bounded: too
    large a text, too many values (aliases expanded) or too deep, and duplicate keys raise
    SpecError naming `source`, before any Python data is built."""
    problem = _size_problem(len(text.encode("utf-8", "surrogatepass")))
    if problem:
        raise SpecError(source, [problem])
    loader = _SpecLoader(text)
    try:
        node = loader.get_single_node()  # nodes only: nothing is built yet
        if loader.duplicates:
            raise SpecError(source, [problem for *_, problem in sorted(loader.duplicates)])
        return None if node is None else loader.construct_document(node)
    except _Refused as exc:
        raise SpecError(source, [exc.problem]) from None
    except SpecError:
        raise
    except ValueError as exc:  # an integer past Python's digit limit (4300), as libyaml's constructor meets it
        raise SpecError(source, [f"(file): a value cannot be read ({str(exc).split(';')[0]}); no field takes a "
                                 "number that long"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = _at(mark) if mark else "(file)"
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(source, [f"{where}: malformed YAML: {problem}"]) from None
    finally:
        loader.dispose()


class ModelChecks(Protocol):
    """The checks of a spec's model section that need its recipe, which this room cannot import:
    the composition roots (the command line, the flows, the workload's program) pass them in,
    `trnflow.workload.recipes.RECIPES`, so what a spec is checked for never depends on what
    happened to be imported before."""

    def rewrite(self, data: dict[str, Any]) -> dict[str, Any]:
        """The parsed spec with `model.params` in the form every job reads the same way (a relative
        path made absolute against the directory trnflow runs from, as data locations are)."""
        ...

    def problems(self, data: dict[str, Any]) -> list[str]:
        """What is wrong with the parsed spec's model section, as `field.path: message` lines."""
        ...


def validate_spec(data: Any, source: str = "<spec>", model: ModelChecks | None = None) -> JobSpec:
    """Validate a parsed mapping into a JobSpec, or raise SpecError listing its problems (those of
    the recipe's params too, with `model`: see `ModelChecks`)."""
    if not isinstance(data, dict):
        raise SpecError(source, [f"(top level): expected a mapping of sections, got {type(data).__name__}"])
    if model is not None:
        data = model.rewrite(data)
    recipe_problems = model.problems(data) if model is not None else []
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as exc:
        problems: dict[str, str] = {}
        for err in exc.errors():
            described = _describe(err)
            lines = described.splitlines()
            # a cross-field check that found several fields wrong says so one field per line
            parts = lines if len(lines) > 1 and all(_OWN_PATH.match(line) for line in lines) else [described]
            for message in parts:
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


def load_spec(path: str | Path, overrides: dict[str, Any] | None = None, model: ModelChecks | None = None
              ) -> JobSpec:
    """Read a YAML (or JSON) job spec file. `overrides` maps dotted field paths to values; `model`,
    see `ModelChecks`."""
    path = Path(path)
    return parse_spec(_read_text(path), str(path), overrides, model)


def _read_text(path: Path) -> str:
    """The file's text, refused unread beyond MAX_SPEC_BYTES (a named pipe or a device too)."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SPEC_BYTES + 1)
            size = max(len(data), os.fstat(file.fileno()).st_size)
    except FileNotFoundError:
        raise SpecError(str(path), ["(file): not found; check the path"]) from None
    except IsADirectoryError:
        raise SpecError(str(path), ["(file): is a folder, not a spec file; give the path of a .yaml spec"]) from None
    except OSError as exc:
        raise SpecError(str(path), [f"(file): cannot be read ({exc.strerror}); check the path and its "
                                    "permissions"]) from None
    problem = _size_problem(size)
    if problem:
        raise SpecError(str(path), [problem])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(str(path), [f"(file): not UTF-8 text ({exc.reason} at byte {exc.start})"]) from None


def parse_spec(text: str, source: str, overrides: dict[str, Any] | None = None, model: ModelChecks | None = None
               ) -> JobSpec:
    """A job spec from YAML (or JSON) text read from `source`, which error messages name."""
    data = _read_yaml(text, source)
    if overrides:
        data = apply_overrides(data if isinstance(data, dict) else {}, overrides)
    return validate_spec(data, source, model)


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
