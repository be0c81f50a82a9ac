"""The training images, one per real device (`infra/docker-bake.json`): both build infra/Dockerfile,
`neuron` on the TorchNeuron deep-learning container (Neuron SDK 2.33 and later; trn2, trn3) and
`xla` on the torch-xla one (SDK 2.31 or earlier, the last to ship it; trn1). Each is labelled with
the instance families it serves, which must be the families trnflow sends to it, and the install
step must resolve for each base image's own Python (the TorchNeuron image's is newer than any on a
build machine, so pip resolves it for that Python without installing). The install itself runs in
test_image_install.py, on the oldest image's Python."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from test_image_install import install_commands, pip, wheel  # noqa: F401 (wheel is a fixture)
from test_python_version import image_pythons

from trnflow.neuron.devices import IMAGES, image_device
from trnflow.specs import validate_spec
from trnflow.specs.instances import TRAINING_TYPES

ROOT = Path(__file__).resolve().parents[2]
TARGETS = json.loads((ROOT / "infra" / "docker-bake.json").read_text())["target"]
SDK = re.compile(r":(?P<torch>[\d.]+)-neuronx-py3\d+-sdk(?P<sdk>\d+\.\d+)[\d.]*-")


def _sdk(device: str) -> tuple[int, int]:
    found = SDK.search(TARGETS[device]["args"]["NEURON_DLC"])
    assert found, f"{TARGETS[device]['args']['NEURON_DLC']}: not a Neuron training container tag"
    major, minor = found.group("sdk").split(".")
    return int(major), int(minor)


def test_one_image_per_real_device_each_on_its_sdks_training_container():
    assert set(TARGETS) == set(IMAGES)
    for device, target in TARGETS.items():
        assert target["dockerfile"] == "infra/Dockerfile" and target["context"] == "."
        assert target["args"]["NEURON_DLC"].startswith("public.ecr.aws/neuron/pytorch-training-neuronx:")
        assert target["labels"]["trnflow.device"] == device
        assert target["tags"] == [f"trnflow-train:{device}"]
    assert _sdk("neuron") >= (2, 33)  # native TorchNeuron
    assert _sdk("xla") <= (2, 31)  # the last SDK with the torch-xla torch-neuronx


@pytest.mark.parametrize("itype", TRAINING_TYPES)
def test_each_instance_family_is_sent_to_the_image_labelled_for_it(itype):
    from tests.conftest import quickstart_data

    spec = validate_spec(quickstart_data(compute={"instance_type": itype, "device": "auto"}))
    chosen = image_device(spec)
    families = TARGETS[chosen]["labels"]["trnflow.instance-families"].split(",")
    assert itype.split(".")[0] in families


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("device", sorted(IMAGES))
def test_the_install_step_resolves_for_the_images_own_python(device, wheel, tmp_path):  # noqa: F811
    major, minor = image_pythons()[device]
    for command in install_commands(wheel):
        resolved = pip(Path(sys.executable), *command, "--dry-run", "--ignore-installed", "--only-binary=:all:",
                       "--python-version", f"{major}.{minor}", "--target", str(tmp_path / "site"), cwd=tmp_path)
        assert resolved.returncode == 0, f"Python {major}.{minor}: pip {' '.join(command)}\n{resolved.stderr[-2000:]}"
