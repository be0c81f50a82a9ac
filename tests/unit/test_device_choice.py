"""`compute.device`: what `auto` picks on each instance family with each SDK installed, the choices
the spec refuses whatever is installed, and the ones `trnflow validate` refuses in this environment."""

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import ON_S3, quickstart_data
from trnflow.cli.app import app
from trnflow.device.registry import DEVICE_ENV, choose
from trnflow.neuron import devices
from trnflow.results import DeviceUsed
from trnflow.specs import SpecError, validate_spec


def _spec(device="auto", instance_type="trn1.2xlarge", backend="local", cores=1, nodes=1):
    return validate_spec(quickstart_data(compute={"device": device, "instance_type": instance_type,
                                                  "backend": backend, "cores_per_node": cores, "nodes": nodes},
                                         train={"global_batch_size": 64 * nodes * cores,
                                                **({"checkpoint_url": "s3://acme-ckpt/x"} if backend != "local"
                                                   else {})},
                                         **({} if backend == "local" else ON_S3)))


def test_the_sdks_are_told_apart_by_their_modules():
    def has(*names):
        return lambda name: name in names

    assert devices.installed(has()) == frozenset()
    assert devices.installed(has("torch_neuronx")) == {"neuron"}  # native TorchNeuron
    assert devices.installed(has("torch_neuronx", "libneuronxla", "torch_xla")) == {"xla"}  # the legacy XLA path
    assert devices.installed(has("torch_xla")) == {"xla"}
    assert devices.installed() == frozenset()  # this environment has neither SDK


def test_auto_takes_the_family_device_only_when_installed_and_provided(monkeypatch):
    monkeypatch.setattr(devices, "PROVIDED", ("emulator", "neuron", "xla"))
    assert devices.resolve(_spec(instance_type="trn2.48xlarge"), frozenset({"neuron"})) == DeviceUsed(
        name="neuron", reason="auto: trn2.48xlarge with native TorchNeuron installed")
    assert devices.resolve(_spec(instance_type="trn1.32xlarge"), frozenset({"xla", "neuron"})).name == "xla"
    fallback = devices.resolve(_spec(instance_type="trn2.48xlarge"), frozenset({"xla"}))
    assert fallback.name == "emulator" and "no Neuron SDK for trn2.48xlarge" in fallback.reason
    monkeypatch.setattr(devices, "PROVIDED", ("emulator",))
    assert devices.resolve(_spec(instance_type="trn1.32xlarge"), frozenset({"xla"})).name == "emulator"
    chosen = devices.resolve(_spec("emulator"), frozenset({"xla"}))
    assert chosen == DeviceUsed(name="emulator", reason="compute.device: emulator")


def test_xla_runs_one_rank_for_now_and_neuron_any_number(monkeypatch):
    monkeypatch.setattr(devices, "PROVIDED", ("emulator", "neuron", "xla"))
    assert devices.problems(_spec("neuron", "trn2.48xlarge", cores=64, nodes=2), local=False) == []
    chosen = devices.resolve(_spec(instance_type="trn2.48xlarge", cores=64, nodes=2), frozenset({"neuron"}))
    assert chosen.name == "neuron"
    (problem,) = devices.problems(_spec("xla", cores=2), local=False)
    assert problem.startswith("compute.device: xla runs one rank") and "is 2; set both to 1" in problem
    chosen = devices.resolve(_spec(instance_type="trn1.32xlarge", cores=2), frozenset({"xla"}))
    assert chosen.name == "emulator" and "the xla device runs one rank" in chosen.reason
    assert devices.resolve(_spec(instance_type="trn1.32xlarge"), frozenset({"xla"})).name == "xla"


def test_the_spec_refuses_a_device_the_instance_family_cannot_run():
    with pytest.raises(SpecError) as bad:
        _spec("neuron", "trn1.32xlarge")
    assert any(p.startswith("compute.device: neuron (native TorchNeuron) runs on trn2") and "xla or auto" in p
               for p in bad.value.problems), bad.value.problems
    assert _spec("neuron", "trn2.48xlarge").compute.device == "neuron"


def test_problems_name_the_field_and_the_fix(monkeypatch):
    assert devices.problems(_spec("auto"), local=True) == devices.problems(_spec("emulator"), local=True) == []
    monkeypatch.setattr(devices, "PROVIDED", ("emulator",))
    (unprovided,) = devices.problems(_spec("xla"), local=True, available=frozenset({"xla"}))
    assert unprovided.startswith("compute.device: xla is not one this trnflow can run yet")
    monkeypatch.setattr(devices, "PROVIDED", ("emulator", "xla"))
    assert devices.problems(_spec("xla"), local=True, available=frozenset({"xla"})) == []
    (missing,) = devices.problems(_spec("xla"), local=True, available=frozenset())
    assert missing.startswith("compute.device: xla needs its SDK") and "pip install torch-xla" in missing
    assert devices.problems(_spec("xla", backend="sagemaker"), local=False, available=frozenset()) == []


def test_validate_reports_the_device_problem_for_the_file(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(compute={"device": "xla"})))
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code == 2, result.output
    assert "invalid" in result.output and "compute.device: xla" in result.output


def test_a_worker_takes_the_environments_device_first(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "emulator")
    assert choose(_spec()) == DeviceUsed(name="emulator", reason=f"{DEVICE_ENV}=emulator")
    monkeypatch.delenv(DEVICE_ENV)
    assert choose(_spec()).reason.startswith("auto: no Neuron SDK for trn1.2xlarge")
    assert choose(None).name == "emulator"
