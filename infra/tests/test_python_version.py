"""The package keeps to the Python of the training images: the oldest image's Python is the oldest
one trnflow runs on, so `requires-python`, ruff's target version and the code itself (checked by
vermin, which knows the version each feature arrived in) must all agree with it."""

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ["trnflow", "flows", "tasks", "jobspecs"]


def image_pythons() -> dict[str, tuple[int, int]]:
    """Each training image's Python, by device, from its base image's tag in infra/docker-bake.json
    (`...-py311-...` -> (3, 11))."""
    targets = json.loads((ROOT / "infra" / "docker-bake.json").read_text())["target"]
    found = {}
    for device, target in targets.items():
        base = target["args"]["NEURON_DLC"]
        tag = re.search(r"-py3(\d+)-", base)
        assert tag, f"infra/docker-bake.json, target {device}: {base} does not say its Python (-py3XX-)"
        found[device] = (3, int(tag.group(1)))
    return found


def image_python() -> tuple[int, int]:
    """The oldest Python among the training images: the one trnflow must run on. The Dockerfile's
    own default base image is that one, so a plain `docker build` gets the image the tests rehearse."""
    oldest = min(image_pythons().values())
    default = re.search(r"^ARG NEURON_DLC=\S+-py3(\d+)-", (ROOT / "infra" / "Dockerfile").read_text(), re.M)
    assert default, "infra/Dockerfile names its default base image in `ARG NEURON_DLC=...-py3XX-...`"
    assert (3, int(default.group(1))) == oldest, "infra/Dockerfile's default base image is the oldest Python's"
    return oldest


def _vermin(target: str, *paths: str) -> subprocess.CompletedProcess:
    vermin = Path(sys.executable).with_name("vermin")  # its console script: the package has no __main__
    return subprocess.run([str(vermin), f"-t={target}-", "--violations", "--no-tips",
                           "--eval-annotations", *paths], cwd=ROOT, capture_output=True, text=True)


def test_requires_python_and_the_linter_target_the_images_python():
    major, minor = image_python()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"].startswith(f">={major}.{minor}")
    assert project["tool"]["ruff"]["target-version"] == f"py{major}{minor}"


def test_the_code_uses_nothing_newer_than_the_images_python():
    major, minor = image_python()
    found = _vermin(f"{major}.{minor}", *PACKAGE)
    assert found.returncode == 0, found.stdout + found.stderr


def test_the_check_does_find_code_too_new(tmp_path):
    """So that a pass above means something: a 3.11 feature fails a 3.10 target."""
    (tmp_path / "new.py").write_text("import datetime\n\nprint(datetime.UTC)\n")
    assert _vermin("3.10", str(tmp_path / "new.py")).returncode != 0
