"""The XLA lane: trnflow's `xla` device on torch-xla's CPU runtime (PJRT_DEVICE=CPU), one rank.

On a Neuron host the same lane runs the device that host has: TRNFLOW_LANE_DEVICE=neuron (trn2,
native TorchNeuron) or xla (trn1, where PJRT_DEVICE is the Neuron runtime's); see docs/devices.md.

Each test records what it showed in `lane` (its report's user properties, which reach the summary
from every xdist worker); the session's summary prints the findings of the tests that passed, so a
CI log says what the lane proved, not only that it passed. Nothing here is skipped when torch-xla is
missing: the lane exists to run it, so a missing SDK is a failure."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
SPEC = HERE / "one-core.yaml"
DEVICE = os.environ.get("TRNFLOW_LANE_DEVICE", "xla")
"""The real device under test; the emulator is what it is compared with."""
INSTANCE = {"xla": "trn1.2xlarge", "neuron": "trn2.48xlarge"}[DEVICE]
SDK = {"xla": "torch_xla", "neuron": "torch_neuronx"}[DEVICE]


@pytest.fixture(scope="session", autouse=True)
def _runtime():
    if DEVICE == "xla" and os.environ.get("PJRT_DEVICE") is None:
        raise AssertionError("set PJRT_DEVICE (CPU here, as make test-xla does; NEURON on a trn1 host)")
    # the lane's subject: its absence is a failure, not a skip
    assert importlib.util.find_spec(SDK) is not None, f"{SDK} is not installed: run `make test-xla` (docs/devices.md)"


@pytest.fixture(scope="session", autouse=True)
def _one_prefect_api(request):
    """The lane's trnflow commands talk to one Prefect API, as a user's do once a server is
    configured, instead of each starting a temporary one of its own: the server `make test` started
    for the lane at the usual priority (TRNFLOW_TEST_PREFECT_API_URL; tests/prefect_server.py), or
    else this test process's own (the session's)."""
    url = os.environ.get("TRNFLOW_TEST_PREFECT_API_URL") or request.getfixturevalue("prefect_api")
    saved = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = url
    yield
    if saved is None:
        os.environ.pop("PREFECT_API_URL", None)
    else:
        os.environ["PREFECT_API_URL"] = saved


class Findings:
    def __init__(self, node: pytest.Item):
        self.node = node

    def __setitem__(self, name: str, finding: str) -> None:
        self.node.user_properties.append(("lane", f"{name}: {finding}"))


@pytest.fixture
def lane(request):
    return Findings(request.node)


def trnflow(*args: str, cwd: Path, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """The trnflow command of this environment, run in `cwd`."""
    done = subprocess.run([sys.executable, "-m", "trnflow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=900)
    if check:
        assert done.returncode == 0, f"trnflow {' '.join(args)}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Path:
    """Three days of synthetic reviews, made once for the session."""
    root = tmp_path_factory.mktemp("data")
    trnflow("data", "synth", str(root / "data"), "--days", "3", "--rows-per-day", "1000", "--holdout-rows", "600",
            "--inference-rows", "600", "--seed", "7", cwd=root)
    return root / "data"


@pytest.fixture
def workdir(tmp_path, data) -> Path:
    """A folder holding the data where the lane's spec expects it."""
    shutil.copytree(data, tmp_path / "data")
    return tmp_path


def write_spec(folder: Path, **sections) -> Path:
    """The lane's spec with `sections` merged into it, written into `folder`."""
    spec = yaml.safe_load(SPEC.read_text())
    spec["compute"]["instance_type"] = INSTANCE
    for section, values in sections.items():
        spec[section] = {**spec.get(section, {}), **values}
    path = folder / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def pytest_terminal_summary(terminalreporter):
    shown = [value for report in terminalreporter.stats.get("passed", []) if report.when == "call"
             for key, value in report.user_properties if key == "lane"]
    if shown:
        terminalreporter.section(f"what the lane showed ({DEVICE})")
        for line in sorted(shown):
            terminalreporter.write_line(line)
