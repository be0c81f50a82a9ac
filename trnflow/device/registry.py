"""Devices by name. The workload asks for a device here and never imports its implementation, so
the emulator (or a real NeuronCore's runtime) is loaded only where it runs.

A worker runs on the device its spec's `compute.device` resolves to on its own host
(`trnflow.neuron.devices`); `TRNFLOW_DEVICE` overrides that for a process (default `emulator`).
"""

from __future__ import annotations

import importlib
import os

from trnflow.device.base import Device
from trnflow.errors import FatalError
from trnflow.neuron.devices import resolve
from trnflow.results import DeviceUsed
from trnflow.specs import JobSpec

DEVICE_ENV = "TRNFLOW_DEVICE"
DEFAULT = "emulator"

_DEVICES: dict[str, str] = {
    "emulator": "trnflow.emulator.device:EmulatorDevice",
    "neuron": "trnflow.device.neuron:NeuronDevice",
    "xla": "trnflow.device.xla:XlaDevice",
}
_made: dict[str, Device] = {}


def register(name: str, target: str) -> None:
    """Make `module:Class` (a `Device` subclass) the device called `name`."""
    _DEVICES[name] = target
    _made.pop(name, None)


def names() -> list[str]:
    return sorted(_DEVICES)


def choose(spec: JobSpec | None) -> DeviceUsed:
    """The device this process runs `spec` on, and why: TRNFLOW_DEVICE when set, else the spec's
    `compute.device` resolved here, else the emulator."""
    if os.environ.get(DEVICE_ENV):
        return DeviceUsed(name=os.environ[DEVICE_ENV], reason=f"{DEVICE_ENV}={os.environ[DEVICE_ENV]}")
    if spec is None:
        return DeviceUsed(name=DEFAULT, reason="no job spec: the default device")
    return resolve(spec)


def get_device(name: str | None = None) -> Device:
    """The device called `name`, else the one TRNFLOW_DEVICE names, else the emulator (one per process)."""
    name = name or os.environ.get(DEVICE_ENV) or DEFAULT
    if name not in _DEVICES:
        raise FatalError(f"{DEVICE_ENV}={name!r} is not a device; choose one of: {', '.join(names())}")
    if name not in _made:
        module, _, cls = _DEVICES[name].partition(":")
        _made[name] = getattr(importlib.import_module(module), cls)()
    return _made[name]
