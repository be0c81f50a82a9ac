"""trnflow installed from its wheel, in one fresh virtual environment of the oldest base image's
Python, in two steps that each must work.

First the training image's install step, rehearsed without a Docker engine: the Dockerfile's own
`pip install` instruction, on a torch that stands for the base image's, with the wheel built from
exactly what the image copies. What it installs must run trnflow as the image does: the `trnflow`
command, and a training step through the container entrypoint with SageMaker's variables. The
Python before the image's (3.10, the old base image's) must be refused, so an image too old for
trnflow fails here.

Then the wheel as a user installs it, without extras (`pip install <wheel>`), into the same
environment, which adds what the image leaves out (Prefect, the SageMaker SDK, matplotlib): the
example specs validate, the quickstart pipeline runs on the local backend, and the mocked cloud,
whose moto is only in the `mock` extra, says how to get it instead of failing on an import. (One
environment, not two: each costs a torch install of a few minutes.) The tests run in file order,
the image's first.

The helpers and the wheel fixture here serve test_images.py too."""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from test_python_version import image_python

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "infra" / "Dockerfile"
EXAMPLES = ROOT / "jobspecs" / "examples"
TIMEOUT = 1800  # only against a hang: an install takes a minute or two
# Packages only the orchestrating side imports: the image leaves them out.
ORCHESTRATION_ONLY = ("prefect", "fastapi", "matplotlib", "sagemaker", "moto")

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _torch_pin() -> str:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if d.startswith("torch==")]
    return pin.removeprefix("torch==")


TORCH = _torch_pin()


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would lead a subprocess to the checkout or its
    virtualenv (PYTHONPATH, VIRTUAL_ENV) or to this session's trnflow, Neuron, SageMaker or Prefect
    settings. pip's own settings stay: they say where this machine's packages are."""
    drop = ("PYTHON", "VIRTUAL_ENV", "TRNFLOW_", "NEURON_", "SM_", "AWS_BATCH_", "PREFECT_")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(drop)}, **extra}


def run(argv: list, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                          timeout=TIMEOUT)


def find_python(minor: int, or_newer: bool = True) -> Path | None:
    """An interpreter of Python 3.<minor> (pyenv's, else one on PATH); with `or_newer`, the oldest
    one above it when there is none."""
    for m in range(minor, 14) if or_newer else (minor,):
        candidates = sorted(glob.glob(str(Path.home() / f".pyenv/versions/3.{m}.*/bin/python3.{m}")))
        on_path = shutil.which(f"python3.{m}")
        if on_path and "/shims/" not in on_path:  # a pyenv shim may name a version that is not installed
            candidates.append(on_path)
        if candidates:
            return Path(candidates[-1])
    return None


def pip(python: Path, command: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run([python, "-m", "pip", command, "--quiet", "--disable-pip-version-check", *args], cwd)


def make_venv(python: Path, where: Path) -> Path:
    """A fresh virtual environment; returns its python."""
    made = run([python, "-m", "venv", where], where.parent)
    assert made.returncode == 0, made.stderr
    return where / "bin" / "python"


def install_torch(venv_python: Path) -> None:
    """torch at pyproject's pin, from a wheel file on this machine only (the CPU build): from an index,
    a torch for another Python would bring several GB of CUDA libraries. Its dependencies come as usual.
    Not byte-compiled on install: of its thousands of modules the tests import a few, compiled then."""
    local = pip(venv_python, "install", "--no-index", "--no-deps", "--no-compile", f"torch=={TORCH}",
                cwd=venv_python.parents[2])
    if local.returncode:
        pytest.skip(f"no local wheel of torch {TORCH} for this Python: {local.stderr.strip()[-300:]}")
    deps = pip(venv_python, "install", f"torch=={TORCH}", cwd=venv_python.parents[2])
    assert deps.returncode == 0, deps.stderr


def instructions() -> list[str]:
    """The Dockerfile's instructions, one string each: continuation lines joined, comments left out."""
    found, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.endswith("\\"):
            current += text[:-1] + " "
            continue
        found.append(current + text)
        current = ""
    return found


def image_context(into: Path) -> Path:
    """The files the Dockerfile's COPY instructions put in the image, laid out as in its WORKDIR."""
    for instruction in instructions():
        if not instruction.startswith("COPY "):
            continue
        *sources, dest = [a for a in shlex.split(instruction)[1:] if not a.startswith("--")]
        for source in sources:
            target = into / dest / Path(source).name if dest.endswith("/") else into / dest
            if (ROOT / source).is_dir():
                shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / source, target)
    return into


def install_commands(wheel: Path) -> list[list[str]]:
    """The image's install step: its one `RUN pip install ...` instruction, split at `&&` into pip
    commands (without the leading `pip`), the source folder `.` replaced by `wheel`."""
    steps = [i for i in instructions() if re.match(r"RUN\s+pip\s+install\s", i)]
    assert len(steps) == 1, "infra/Dockerfile installs trnflow in one `RUN pip install ... && pip install ...`"
    commands = []
    for part in steps[0].removeprefix("RUN").split("&&"):
        argv = shlex.split(part)
        assert argv[:2] == ["pip", "install"], f"{part.strip()}: the install step holds pip install commands only"
        commands.append([str(wheel) if a == "." else a for a in argv[1:]])
    assert any(str(wheel) in c for c in commands), "the install step installs trnflow from the image's `.`"
    return commands


@functools.cache
def _build_wheel(out: Path) -> Path:
    context = image_context(out / "context")
    built = run([sys.executable, "-m", "pip", "wheel", "-v", "--disable-pip-version-check", "--no-deps",
                 "-w", out / "dist", context], out)
    assert built.returncode == 0, built.stderr
    (out / "build.log").write_text(built.stdout + built.stderr)  # the build backend's output, for its warnings
    (wheel,) = (out / "dist").glob("trnflow-*.whl")
    return wheel


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """trnflow's wheel, built once a session from what the Dockerfile copies into the image (so a
    file the image lacks is missing from it too)."""
    return _build_wheel(tmp_path_factory.getbasetemp() / "trnflow-wheel")


def image_venv(tmp_path_factory, name: str) -> Path:
    """The python of a fresh venv of the image's Python (or the oldest newer one here); skips
    when this machine has none."""
    _, minor = image_python()
    python = find_python(minor)
    if python is None:
        pytest.skip(f"no Python 3.{minor} or newer on this machine to stand for the image's Python 3.{minor}")
    return make_venv(python, tmp_path_factory.mktemp(name) / "venv")


@pytest.fixture(scope="module")
def image_python_env(wheel, tmp_path_factory) -> Path:
    """A fresh venv of the image's Python and torch, after exactly the image's install step (but
    not byte-compiled, as torch above: transformers alone has thousands of modules, and the tests
    import a few)."""
    venv_python = image_venv(tmp_path_factory, "image")
    venv = venv_python.parents[1]
    commands = install_commands(wheel)
    # First whether the image's Python takes trnflow at all: one it refuses fails here, whether or
    # not this machine has a torch for it.
    accepted = pip(venv_python, *commands[0], "--dry-run", cwd=venv.parent)
    assert accepted.returncode == 0, f"pip {shlex.join(commands[0])}\n{accepted.stderr}"
    install_torch(venv_python)
    for command in commands:
        done = pip(venv_python, *command, "--no-compile", cwd=venv.parent)
        assert done.returncode == 0, f"pip {shlex.join(command)}\n{done.stderr}"
    return venv_python


# Run in the image's venv: imports what the container and every workload phase import, then reports.
PROBE = """
import importlib, importlib.util, json, sys
import torch, trnflow, trnflow.backends.container, trnflow.emulator.device
from trnflow.workload.__main__ import PHASES
for phase in PHASES:
    importlib.import_module(f"trnflow.workload.{phase}")
print(json.dumps({"torch": torch.__version__, "trnflow": trnflow.__file__, "phases": list(PHASES),
                  "present": [m for m in sys.argv[1:] if importlib.util.find_spec(m)]}))
"""


def test_every_phase_imports_on_the_base_images_torch_without_the_orchestration(image_python_env, tmp_path):
    found = run([image_python_env, "-c", PROBE, *ORCHESTRATION_ONLY], tmp_path)
    assert found.returncode == 0, found.stderr
    seen = json.loads(found.stdout)
    assert {"train", "evaluate", "infer"} <= set(seen["phases"])
    assert seen["torch"].split("+")[0] == TORCH  # the install step left the base image's torch alone
    assert Path(seen["trnflow"]).is_relative_to(image_python_env.parents[1])  # the wheel's, not the checkout's
    assert seen["present"] == []


def test_the_trnflow_command_runs_in_the_image(image_python_env, tmp_path):
    trnflow = image_python_env.with_name("trnflow")
    helped = run([trnflow, "--help"], tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "validate" in helped.stdout and "run" in helped.stdout
    checked = run([trnflow, "validate", EXAMPLES / "quickstart.yaml"], tmp_path)
    assert checked.returncode == 0, checked.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_training_step_through_the_container_entrypoint(image_python_env, tmp_path):
    """`python -m trnflow.backends.container train` as SageMaker starts the image: a one-step quickstart on
    one NeuronCore of the emulator, from the spec channel to a committed checkpoint."""
    synth = run([image_python_env.with_name("trnflow"), "data", "synth", tmp_path / "data", "--days", "1",
                 "--rows-per-day", "64", "--holdout-rows", "32", "--inference-rows", "16"], tmp_path)
    assert synth.returncode == 0, synth.stderr
    spec = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    spec["data"].update({name: str(tmp_path / "data" / name) for name in ("train", "holdout", "inference")})
    spec["compute"]["cores_per_node"] = 1
    spec["compile"]["cache_url"] = str(tmp_path / "compile-cache")
    spec["train"].update(steps=1, checkpoint_every=1, log_every=1, global_batch_size=8,
                         checkpoint_url=str(tmp_path / "checkpoints"))
    spec["train"]["parallelism"] = {"strategy": "ddp", "tp": 1}  # as every backend decides it before the job
    spec["gate"].update(reference=None, eval_every=None)
    spec["inference"]["output_url"] = str(tmp_path / "embeddings")
    spec["registry_url"] = str(tmp_path / "registry")
    opt_ml = tmp_path / "opt_ml"
    channel = opt_ml / "input" / "data" / "spec"
    channel.mkdir(parents=True)
    (channel / "spec.json").write_text(json.dumps(spec))

    env = clean_env(
        TRNFLOW_OPT_ML=str(opt_ml), SM_HOSTS='["algo-1"]', SM_CURRENT_HOST="algo-1", SM_MASTER_ADDR="127.0.0.1",
        SM_MASTER_PORT=str(_free_port()), SM_CHANNEL_SPEC=str(channel),
        SM_OUTPUT_DATA_DIR=str(opt_ml / "output" / "data"), TRNFLOW_PHASE="train", TRNFLOW_RUN_ID="smoke",
        TRNFLOW_NPROC_PER_NODE="1", TRNFLOW_NEURON_RT_DIR=str(tmp_path / "neuron-rt"),
        TRNFLOW_HOME=str(tmp_path / "home"))
    trained = run([image_python_env, "-m", "trnflow.backends.container", "train"], tmp_path, env)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert not (opt_ml / "output" / "failure").exists()
    result = json.loads((opt_ml / "output" / "data" / "result.json").read_text())
    assert result["phase"] == "train" and result["global_step"] == 1
    checkpoint = tmp_path / "checkpoints" / "smoke" / "step-000001"
    assert result["checkpoint"] == checkpoint.as_uri()
    written = {p.name for p in checkpoint.iterdir()}
    assert {"COMMITTED", "model.pt", "optim.pt", "tokenizer.json", "meta.json"} <= written


def test_the_python_before_the_images_is_refused(wheel, tmp_path):
    """The image's install step on the Python before the image's (3.10 for a 3.11 image, the old
    base image's) stops at trnflow's requires-python: a base image too old fails the fixture above."""
    _, minor = image_python()
    older = find_python(minor - 1, or_newer=False)
    if older is None:
        pytest.skip(f"no Python 3.{minor - 1} on this machine")
    first = install_commands(wheel)[0]  # trnflow itself; into a folder of its own, should pip accept it
    refused = pip(older, *first, "--dry-run", "--ignore-installed", "--target", str(tmp_path / "site"), cwd=tmp_path)
    assert refused.returncode != 0
    assert "requires a different Python" in refused.stderr, refused.stderr


# The wheel as a user installs it: after the image's tests, in the same environment.

@pytest.fixture(scope="module")
def installed(image_python_env, wheel):
    """The image's environment after `pip install <wheel>`, as a user installs trnflow: the wheel's
    own dependencies come in beside the image's packages (its torch is the wheel's pin). Not
    byte-compiled on install (as torch above): the tests import a part of those packages, compiled
    then, since their processes may write bytecode."""
    done = pip(image_python_env, "install", "--no-compile", str(wheel), cwd=image_python_env.parents[2])
    assert done.returncode == 0, done.stderr
    return image_python_env


def test_every_example_spec_validates(installed, tmp_path):
    examples = sorted(EXAMPLES.glob("*.yaml"))
    checked = run([installed.with_name("trnflow"), "validate", *examples], tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("ok ") == len(examples) >= 3
    # and the wheel carries the same examples
    shipped = installed.parents[1].glob("lib/python3.*/site-packages/trnflow/specs/examples/*.yaml")
    assert sorted(p.name for p in shipped) == [p.name for p in examples]


def test_building_the_wheel_gives_no_setuptools_warning(wheel):
    """The package configuration is complete: setuptools finds no package data folder that is not
    declared (its BuildBackendWarning), and nothing deprecated."""
    log = (wheel.parents[1] / "build.log").read_text()
    warnings = [line.strip() for line in log.splitlines()
                if "Warning" in line or ("warning:" in line and "byte-compiling is disabled" not in line)]
    assert warnings == []


def test_the_quickstart_pipeline_runs_on_the_local_backend(installed, tmp_path):
    trnflow = installed.with_name("trnflow")
    synth = run([trnflow, "data", "synth", tmp_path / "data", "--days", "1", "--rows-per-day", "128",
                 "--holdout-rows", "64", "--inference-rows", "48"], tmp_path)
    assert synth.returncode == 0, synth.stderr
    spec = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    spec["data"].update({name: str(tmp_path / "data" / name) for name in ("train", "holdout", "inference")})
    spec["compute"]["cores_per_node"] = 1
    spec["compile"]["cache_url"] = str(tmp_path / "compile-cache")
    spec["train"].update(steps=2, checkpoint_every=2, log_every=1, checkpoint_url=str(tmp_path / "checkpoints"))
    spec["gate"].update(reference=None, eval_every=None)
    spec["inference"]["output_url"] = str(tmp_path / "embeddings")
    spec["registry_url"] = str(tmp_path / "registry")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    env = clean_env(TRNFLOW_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"),
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", TRNFLOW_NEURON_RT_DIR=str(tmp_path / "neuron-rt"),
                    TRNFLOW_POLL_SECONDS="0.2")
    ran = run([trnflow, "run", tmp_path / "spec.yaml", "--json"], tmp_path, env)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    outcome = json.loads(ran.stdout)
    assert outcome["state"] == "Completed"
    assert [(s["stage"], s["state"]) for s in outcome["stages"]] == [
        (stage, "Completed") for stage in ("sanity", "collectives", "compile", "train", "evaluate", "infer",
                                           "promote")]
    checkpoint = tmp_path / "checkpoints" / outcome["run_id"] / "step-000002"
    assert outcome["results"]["train"]["checkpoint"] == checkpoint.as_uri()
    assert (checkpoint / "COMMITTED").is_file()
    assert json.loads((tmp_path / "embeddings" / "_current.json").read_text())["folder"] == "v000001"
    manifest = json.loads((tmp_path / "embeddings" / "v000001" / "_manifest.json").read_text())
    assert manifest["rows"] == 48


def test_the_mocked_cloud_needs_the_mock_extra(installed, tmp_path):
    imported = run([installed, "-c", "import moto"], tmp_path)
    assert imported.returncode != 0 and "ModuleNotFoundError" in imported.stderr
    mocked = run([installed.with_name("trnflow"), "mock-aws"], tmp_path)
    assert mocked.returncode != 0
    assert "trnflow[mock]" in mocked.stderr, mocked.stdout + mocked.stderr
