"""The README and docs/ checked against the code: the generated job-spec reference is current and
complete, the README is short and starts with the two set-up commands, every link resolves, and
every `trnflow` command, option, `make` target and repository path they name exists."""

from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path

import pytest
import typer

from tests.markdown import FENCE, shell_blocks
from trnflow.cli.app import app
from trnflow.specs import JobSpec, reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SPEC_REFERENCE = ROOT / "docs" / "spec-reference.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def _shell_lines(text: str) -> list[str]:
    """Command lines of the page's shell blocks (`tests.markdown.shell_blocks`)."""
    return [line for block in shell_blocks(text) for line in block]


def _mentions(page: Path) -> list[str]:
    """Everything a page shows as code: shell-block lines and inline code spans outside blocks."""
    text = page.read_text()
    return _shell_lines(text) + [span.replace("\\|", "|") for span in INLINE_CODE.findall(_prose(text))]


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), re.MULTILINE):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


# --- the generated job-spec reference ---------------------------------------------------------------


def test_the_committed_spec_reference_is_what_the_spec_models_render():
    committed = SPEC_REFERENCE.read_text() if SPEC_REFERENCE.exists() else ""
    rendered = reference.markdown()
    if committed != rendered:
        diff = "\n".join(list(difflib.unified_diff(committed.splitlines(), rendered.splitlines(),
                                                   "docs/spec-reference.md", "rendered", lineterm=""))[:40])
        pytest.fail(f"docs/spec-reference.md is out of date; regenerate it from the project root with\n"
                    f"    {reference.COMMAND}\n{diff}")


def test_every_field_of_the_spec_schema_is_in_the_reference():
    schema = JobSpec.model_json_schema()
    definitions = schema["$defs"]
    text = SPEC_REFERENCE.read_text()

    def section_of(prop: dict) -> tuple[str | None, bool]:
        """The $defs name a property refers to, and whether it is a list of them."""
        if "$ref" in prop:
            return prop["$ref"].rsplit("/", 1)[-1], False
        if "items" in prop:
            return section_of(prop["items"])[0], True
        for branch in prop.get("anyOf", []):
            found, listed = section_of(branch)
            if found:
                return found, listed
        return None, False

    missing = []
    for name, prop in schema["properties"].items():
        if f"`{name}`" not in text:
            missing.append(name)
        section, listed = section_of(prop)
        if section is None:
            continue
        assert section in definitions, section
        for field in definitions[section]["properties"]:
            path = f"{name}[].{field}" if listed else f"{name}.{field}"
            if f"`{path}`" not in text:
                missing.append(path)
    assert missing == [], f"fields missing from docs/spec-reference.md: {missing}"


# --- the README's shape ------------------------------------------------------------------------------


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_first_screen_has_the_set_up_commands_and_the_main_job():
    first_screen = "\n".join(README.read_text().splitlines()[:40])
    for needed in ("make demo", "make test", "trnflow run jobspecs/examples/quickstart.yaml"):
        assert needed in first_screen, f"{needed!r} is not in the README's first 40 lines"


# --- links, commands, make targets and paths ---------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_points_at_an_existing_file_and_heading(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading with that anchor in {_rel(file)})")
    assert broken == [], f"{_rel(page)}: broken links {broken}"


def _options(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *getattr(param, "secondary_opts", []))} | {
        "--help"}


def _is_group(command) -> bool:
    """typer's click conversion: a group has sub-commands (typer may vendor its own click)."""
    return isinstance(getattr(command, "commands", None), dict)


def _check_trnflow_command(line: str, root) -> list[str]:
    """What is wrong with one `trnflow ...` mention: an unknown command, sub-command or option."""
    try:
        words = shlex.split(line)
    except ValueError:
        words = line.split()
    commands = [root]
    problems = []
    arguments = False  # past the (sub-)command: the rest are its arguments and options
    for word in words[1:]:
        word = word.strip("[]")
        if not word or word in ("...", "|"):
            continue
        if word.startswith("-"):
            option = word.split("=", 1)[0]
            problems += [f"{line!r}: {c.name} has no option {option}" for c in commands if option not in _options(c)]
            continue
        groups = [c for c in commands if _is_group(c)]
        if arguments or len(groups) < len(commands) or not groups or not re.fullmatch(r"[a-z][a-z0-9|-]*", word):
            arguments = True  # an argument or a placeholder (SPEC, RUN)
            continue
        names = word.split("|")
        unknown = [n for n in names for g in groups if n not in g.commands]
        if unknown:
            problems.append(f"{line!r}: no command {unknown[0]!r} in {' '.join(c.name or 'trnflow' for c in groups)}")
            break
        commands = [g.commands[n] for g in groups for n in names]
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_trnflow_command_shown_is_a_real_command_with_real_options(page):
    root = typer.main.get_command(app)
    assert _is_group(root)
    shown = [m for m in _mentions(page) if re.match(r"trnflow( |$)", m)]
    problems = [p for line in shown for p in _check_trnflow_command(line, root)]
    assert problems == [], f"{_rel(page)}: {problems}"


def test_the_command_check_catches_unknown_commands_and_options():
    root = typer.main.get_command(app)
    assert _check_trnflow_command("trnflow cache ls|stats runs/compile-cache", root) == []
    assert _check_trnflow_command("trnflow run SPEC [--run-id ID]", root) == []
    assert _check_trnflow_command("trnflow models ls|show -r REGISTRY", root) == []
    assert _check_trnflow_command("trnflow launch SPEC", root) != []
    assert _check_trnflow_command("trnflow cache purge URL", root) != []
    assert _check_trnflow_command("trnflow run SPEC --fast", root) != []


def _make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([^\s#=:][^=:]*?):(?!=)", makefile, re.MULTILINE) for t in line.split()}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_make_target_named_exists(page):
    targets = _make_targets()
    named = {m.split()[1] for m in _mentions(page) if re.match(r"make [a-z]", m)}
    assert named - targets == set(), f"{_rel(page)} names make targets the Makefile lacks"


REPO_PATH = re.compile(r"^(?:trnflow|flows|tasks|jobspecs|tests|infra|benchmarks|docs)/[\w./-]*$")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_repository_path_named_exists(page):
    named = {m.split(":")[0] for m in _mentions(page) if REPO_PATH.match(m.split(":")[0])}
    assert sorted(p for p in named if not (ROOT / p).exists()) == [], f"{_rel(page)} names paths that do not exist"


def _commands(group, prefix: tuple[str, ...] = ()):
    """Every command of the `trnflow` app with its path of names, subcommands included."""
    import typer.main

    click_group = typer.main.get_command(group) if not hasattr(group, "commands") else group
    for name, command in sorted(click_group.commands.items()):
        if command.hidden:
            continue
        if hasattr(command, "commands"):
            yield from _commands(command, (*prefix, name))
        else:
            yield (*prefix, name), command


def test_every_command_line_flag_is_in_the_command_table():
    """Item 14: each command's row of the table in docs/operations.md names every one of its
    options (`--help` aside), so a reader of the table knows all a command takes."""
    from trnflow.cli.app import app

    text = (ROOT / "docs" / "operations.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| `trnflow ")]
    missing = []
    for path, command in _commands(app):
        name = " ".join(path)
        rows = [r for r in table if re.match(rf"\| `trnflow {re.escape(path[0])}\b", r)
                and (len(path) == 1 or re.search(rf"\b{re.escape(path[-1])}\b", re.split(r"(?<!\\)\|", r)[1]))]
        text = " ".join(rows)
        for param in command.params:
            if param.param_type_name != "option" or "--help" in param.opts:
                continue
            flags = [*param.opts, *param.secondary_opts]
            if not any(re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text) for f in flags):
                missing.append(f"trnflow {name} {flags[0]}")
    assert missing == [], "\n".join(missing)
