"""Every shell command in the README runs, or is mapped to what runs it.

The README's commands are, by convention, every line of its ```sh and ```bash blocks that is not a
comment (a trailing `# ...` is a comment too, and a line ending in `\\` continues on the next), and
every line starting with `$ ` in its ```console blocks. Blocks in any other language, or none, are
output or code and are not run.

Each `trnflow ...` command runs for real, in README order, in a temporary working copy: its own
TRNFLOW_HOME and PREFECT_HOME, and a folder where `jobspecs/examples/` and `runs/` resolve as they
do at the project root, so nothing is written into the project. Three things keep it to a minute
or two: the working copy's quickstart spec trains 40 steps instead of 300; its `runs/compile-cache`
is the test session's warm compile cache, as it would be the second time `make demo` runs; and the
commands talk to the session's Prefect API (PREFECT_API_URL), as a user's do once a server is
configured, instead of each starting a temporary one (the wheel's quickstart in
infra/tests/test_image_install.py runs without one). The other commands are in RUN_ELSEWHERE,
each with the file that runs it and the call that shows it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.markdown import shell_blocks

README = ROOT / "README.md"
TRNFLOW = Path(sys.executable).with_name("trnflow")
QUICKSTART = "jobspecs/examples/quickstart.yaml"
SHORTER = {"train": {"steps": 40, "checkpoint_every": 20, "log_every": 10}, "gate": {"eval_every": 20}}
"""What the working copy's quickstart spec changes: fewer steps, the same graphs."""

RUN_ELSEWHERE = {
    # README command: (the file that runs it, the call in that file that runs it)
    "make demo": ("tests/integration/test_readme.py", "def test_make_demo_runs_the_readme_main_job"),
    "make test": ("Makefile", "$(MAKE) -j5 test-xla-beside test-unit-beside checkov-beside test-main"),
    "make test-fast": ("Makefile", '-m "unit and not slow" tests/unit'),
    "trnflow mock-aws --port 5000": ("tests/integration/test_mock_aws_docs.py", '"mock-aws", "--port"'),
    "export AWS_ENDPOINT_URL=http://127.0.0.1:5000": ("tests/integration/test_mock_aws_docs.py",
                                                      '"AWS_ENDPOINT_URL": endpoint'),
    "trnflow run jobspecs/examples/quickstart-batch.yaml": ("tests/integration/test_mock_aws_docs.py",
                                                            '"run", "jobspecs/examples/quickstart-batch.yaml"'),
}
"""Commands this file does not run. `make demo` runs the README's main job, which this file runs
and checks against the demo target's recipe; `make test` and `make test-fast` are the test runs
themselves, and the Makefile target must hold the call that runs them (for `make test`, its
branches: the tests in the main environment beside the XLA lane); the mock cloud's block runs in a
test of its own, against a `trnflow mock-aws` server."""

pytestmark = [pytest.mark.integration]


def readme_commands() -> list[str]:
    return [c for block in shell_blocks(README.read_text()) for c in block]


def main_job() -> list[str]:
    """The README's main job: the shell block that runs the quickstart pipeline."""
    (block,) = [b for b in shell_blocks(README.read_text()) if f"trnflow run {QUICKSTART}" in b]
    return block


def make_recipes() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The Makefile's prerequisites and recipes by target, variables expanded."""
    text = (ROOT / "Makefile").read_text()
    variables = dict(re.findall(r"^(\w+)\s*[?:]?=\s*(.*?)\s*$", text, re.MULTILINE))

    def expand(value: str) -> str:
        for _ in range(5):
            value = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), value)
        return value

    prerequisites: dict[str, list[str]] = {}
    recipes: dict[str, list[str]] = {}
    target = None
    for line in text.splitlines():
        if line.startswith("\t") and target:
            recipes[target].append(expand(line.strip()))
        elif (rule := re.match(r"^([^\s#=:][^=:]*?):(?!=)(.*)$", line)) is not None:
            target = expand(rule.group(1).strip())
            prerequisites[target] = expand(rule.group(2)).split()
            recipes[target] = []
        elif not line.startswith("\t"):
            target = None
    return prerequisites, recipes


def steps_of(target: str) -> list[str]:
    """What `make TARGET` runs in a fresh checkout: its prerequisites' recipes, then its own."""
    prerequisites, recipes = make_recipes()
    out = []
    for needed in prerequisites.get(target, []):
        if needed in recipes:
            out += steps_of(needed)
    return out + recipes[target]


def test_every_readme_command_is_run_here_or_mapped_to_what_runs_it():
    commands = readme_commands()
    assert commands, "the README shows no commands"
    not_covered = [c for c in commands if not c.startswith("trnflow ") and c not in RUN_ELSEWHERE]
    assert not_covered == [], f"README commands neither run here nor in RUN_ELSEWHERE: {not_covered}"
    assert set(RUN_ELSEWHERE) <= set(commands), "RUN_ELSEWHERE lists commands the README no longer shows"
    _, recipes = make_recipes()
    for command, (where, call) in RUN_ELSEWHERE.items():
        assert (ROOT / where).is_file(), f"{command}: {where} does not exist"
        if command.startswith("make "):
            target = command.split()[1]
            assert target in recipes, f"{command}: the Makefile has no target {target}"
        text = "\n".join(recipes[target]) if where == "Makefile" else (ROOT / where).read_text()
        assert call in text, f"{command}: {where} should run it with {call!r}"


def test_make_demo_runs_the_readme_main_job():
    """`make demo` makes the data, then runs exactly the README's main job (with .venv's trnflow)."""
    demo = [re.sub(r"^\S*/bin/", "", step) for step in steps_of("demo")]  # $(BIN)/trnflow -> trnflow
    assert [step for step in demo if step.startswith("trnflow ")] == main_job()


@pytest.fixture
def working_copy(tmp_path, warm_compile_cache, prefect_api) -> tuple[Path, dict[str, str]]:
    """A folder where the README's relative paths resolve, and the environment to run it in."""
    work = tmp_path / "work"
    shutil.copytree(ROOT / "jobspecs" / "examples", work / "jobspecs" / "examples")
    spec_path = work / QUICKSTART
    spec = yaml.safe_load(spec_path.read_text())
    for section, values in SHORTER.items():
        spec[section] = {**spec[section], **values}
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    (work / "runs").mkdir()
    (work / "runs" / "compile-cache").symlink_to(warm_compile_cache, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "TRNFLOW_", "AWS_"))}
    env |= {"TRNFLOW_HOME": str(tmp_path / "trnflow-home"), "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_API_URL": prefect_api, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TRNFLOW_POLL_SECONDS": "0.2",
            "TRNFLOW_NEURON_RT_DIR": os.environ["TRNFLOW_NEURON_RT_DIR"], "COLUMNS": "200"}
    return work, env


def run(command: str, work: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """One README command, as a user types it: `trnflow` is the project's installed command."""
    args = command.split()
    assert args[0] == "trnflow" and not set("'\"$|;&<>*") & set(command), f"not a plain command: {command!r}"
    return subprocess.run([str(TRNFLOW), *args[1:]], cwd=work, env=env, capture_output=True, text=True,
                          timeout=1200)


def readme_stage_rows() -> list[tuple[str, str]]:
    """(stage, state) of each row of the README's example stage table."""
    rows = re.findall(r"^(sanity|collectives|compile|train|evaluate|infer|promote)\s+(\w+)\s", README.read_text(),
                      re.MULTILINE)
    assert [stage for stage, _ in rows] == ["sanity", "collectives", "compile", "train", "evaluate", "infer",
                                            "promote"]
    return rows


@pytest.mark.slow
def test_the_readme_commands_run(working_copy):
    work, env = working_copy
    commands = [c for c in readme_commands() if c.startswith("trnflow ") and c not in RUN_ELSEWHERE]
    assert main_job()[-1] in commands
    outputs = {}
    for command in commands:
        done = run(command, work, env)
        assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs[command] = done.stdout

    # the main job: data, a valid spec, its reference, and a run whose every stage completed
    data = work / "runs" / "quickstart" / "data"
    assert sorted(p.name for p in (data / "train").iterdir()) == ["dt=2026-01-01", "dt=2026-01-02", "dt=2026-01-03"]
    assert (work / "runs" / "quickstart" / "reference" / "metrics.json").is_file()
    table = outputs[f"trnflow run {QUICKSTART}"]
    for stage, state in readme_stage_rows():
        assert re.search(rf"│ {stage}\s+│ {state}\s+│", table), f"{stage} is not {state}:\n{table}"
    assert "champion v1 (the first)" in " ".join(table.split())
    assert (work / "runs" / "quickstart" / "embeddings" / "v000001" / "_manifest.json").is_file()
    assert (work / "runs" / "quickstart" / "embeddings" / "_current.json").is_file()

    # what the README says the two commands after it show
    for command, output in outputs.items():
        if command.startswith("trnflow models ls"):
            assert re.search(r"quickstart\s+│ v1\s+│ ★ champion │ passed", output), output
        if command.startswith("trnflow cache ls"):
            done = [line for line in output.splitlines() if re.search(r"\sMODULE_\S+\s+done\s", line)]
            assert len(done) >= 3, output  # train, eval and embed steps
