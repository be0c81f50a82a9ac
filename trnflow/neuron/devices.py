"""Which device a job runs on: `compute.device` (auto, emulator, neuron or xla) resolved against the
instance family and the Neuron SDK that is installed where the job runs. Torch-free: the CLI checks
a spec with it before any job starts, and each worker resolves `auto` again on its own host.

- `neuron`: native TorchNeuron (`torch_neuronx` as a PrivateUse1 device), Neuron SDK 2.33 and later,
  on trn2 and trn3. Told apart from the legacy torch-neuronx, which ships the same module name, by
  the legacy path's XLA runtime (`libneuronxla`) being absent.
- `xla`: torch-xla lazy tensors, the legacy torch-neuronx path that trn1 fleets run (and, with
  `PJRT_DEVICE=CPU`, a local rehearsal of it).
- `emulator`: trnflow's NeuronCore emulator, on any machine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

from trnflow.results import DeviceUsed
from trnflow.specs import JobSpec, instance

PROVIDED: tuple[str, ...] = ("emulator", "neuron", "xla")
"""The devices this trnflow can run a job on (see `trnflow.device.registry`)."""
ONE_RANK_ONLY = {"xla": 1}
"""Devices that run one rank in this version. On xla, DDP's all-reduce is traced into the training
step's graph, so a multi-rank run's graphs differ from those the one-process trial run of
ahead-of-time compilation records; until the trial runs every rank, the recompile guard would
refuse the run."""
INSTALL = {
    "neuron": "install the Neuron SDK's torch-neuronx (2.33 or later) from the Neuron repository",
    "xla": "pip install torch-xla (2.9 runs here on the CPU with PJRT_DEVICE=CPU)",
}


IMAGES: tuple[str, ...] = ("neuron", "xla")
"""The training images, one per real device: `neuron` on the TorchNeuron deep-learning container
(trn2, trn3), `xla` on the torch-xla one (trn1). The emulator runs in either."""


def image_device(spec: JobSpec) -> str:
    """Which training image runs a cloud job of `spec`: its device's, or for `auto` and the
    emulator, the one its instance family's SDK comes in (trn1: xla; trn2, trn3: neuron)."""
    if spec.compute.device in IMAGES:
        return spec.compute.device
    return "neuron" if instance(spec.compute.instance_type).native_torch else "xla"


def has_module(name: str) -> bool:
    """Whether `import name` would find the module, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def installed(has: Callable[[str], bool] = has_module) -> frozenset[str]:
    """The real devices whose SDK this environment has."""
    found = set()
    if has("torch_neuronx") and not has("libneuronxla"):
        found.add("neuron")
    if has("torch_xla"):
        found.add("xla")
    return frozenset(found)


def resolve(spec: JobSpec, available: frozenset[str] | None = None) -> DeviceUsed:
    """The device for `spec` where `available` (by default: the SDKs installed here) are the real
    devices at hand. `auto` takes the device that matches the instance family when its SDK is
    installed and trnflow provides it, else the emulator."""
    wanted, itype = spec.compute.device, spec.compute.instance_type
    available = installed() if available is None else available
    if wanted != "auto":
        return DeviceUsed(name=wanted, reason=f"compute.device: {wanted}")
    family = instance(itype).device_type
    for device in ("neuron",) if instance(itype).native_torch else ("xla",):
        if device in available and device in PROVIDED:
            sdk = "native TorchNeuron" if device == "neuron" else "torch-xla"
            if spec.compute.world_size > ONE_RANK_ONLY.get(device, spec.compute.world_size):
                return DeviceUsed(name="emulator", reason=f"auto: {itype} has {sdk}, but the {device} device runs "
                                  f"one rank in this version and the spec has {spec.compute.world_size}, so the "
                                  "NeuronCore emulator")
            return DeviceUsed(name=device, reason=f"auto: {itype} with {sdk} installed")
    return DeviceUsed(name="emulator", reason=f"auto: no Neuron SDK for {itype} here ({family}), so the NeuronCore "
                      "emulator")


def problems(spec: JobSpec, local: bool, available: frozenset[str] | None = None) -> list[str]:
    """What stops the spec's device choice, as `field: message` lines. `local`: the job runs in
    this environment, so the device's SDK must be installed here (a cloud job's image has its own).
    The instance family is the spec's own check (`ComputeSpec`)."""
    wanted = spec.compute.device
    found: list[str] = []
    if wanted in ("auto", "emulator"):
        return found
    if wanted not in PROVIDED:
        found.append(f"compute.device: {wanted} is not one this trnflow can run yet (it runs: "
                     f"{', '.join(PROVIDED)}); set compute.device to auto or emulator")
    elif spec.compute.world_size > ONE_RANK_ONLY.get(wanted, spec.compute.world_size):
        found.append(f"compute.device: {wanted} runs one rank in this version, and compute.nodes x "
                     f"compute.cores_per_node is {spec.compute.world_size}; set both to 1, or set compute.device to "
                     "emulator (or auto)")
    elif local and wanted not in (installed() if available is None else available):
        found.append(f"compute.device: {wanted} needs its SDK where the job runs, and this environment has none: "
                     f"{INSTALL[wanted]}, or set compute.device to auto or emulator")
    return found
