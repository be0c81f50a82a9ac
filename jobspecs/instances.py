"""The catalogue of Trainium and Inferentia instance types: the one source of truth for topology.

Spec validation, the emulator's devices, memory checks and cost reports all read this table.
Prices are on-demand us-east-1 Linux figures and only a default: a spec can override them.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class InstanceType:
    """One EC2 instance type with Neuron devices."""

    name: str
    device_type: str
    """"trainium", "trainium2" or "inferentia2"."""
    chips: int
    cores_per_chip: int
    """NeuronCores visible per device (for trn2: logical cores at the default LNC=2)."""
    device_memory_gib: int
    """High-bandwidth memory per device (chip)."""
    neuroncore_version: str
    vcpus: int
    host_memory_gib: int
    efa_devices: int
    network_gbps: int
    price_per_hour: float | None
    """On-demand USD per hour; None where no reliable public figure exists."""

    @property
    def cores(self) -> int:
        return self.chips * self.cores_per_chip

    @property
    def core_memory_bytes(self) -> int:
        return self.device_memory_gib * GIB // self.cores_per_chip

    @property
    def trainium(self) -> bool:
        return self.device_type.startswith("trainium")

    @property
    def native_torch(self) -> bool:
        """Whether native TorchNeuron runs here: NeuronCore-v3 and later (trn2, trn3). NeuronCore-v2
        (trn1, inf2) runs PyTorch through torch-xla."""
        return self.neuroncore_version != "v2"

    @property
    def multi_node(self) -> bool:
        """Whether instances of this type can train together (EFA)."""
        return self.efa_devices > 0


CATALOGUE: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType("trn1.2xlarge", "trainium", 1, 2, 32, "v2", 8, 32, 0, 25, 1.34375),
        InstanceType("trn1.32xlarge", "trainium", 16, 2, 32, "v2", 128, 512, 8, 800, 21.50),
        InstanceType("trn1n.32xlarge", "trainium", 16, 2, 32, "v2", 128, 512, 16, 1600, 24.78),
        InstanceType("trn2.48xlarge", "trainium2", 16, 4, 96, "v3d", 192, 2048, 16, 3200, None),
        InstanceType("inf2.xlarge", "inferentia2", 1, 2, 32, "v2", 4, 16, 0, 15, 0.7582),
        InstanceType("inf2.8xlarge", "inferentia2", 1, 2, 32, "v2", 32, 128, 0, 25, 1.96786),
        InstanceType("inf2.24xlarge", "inferentia2", 6, 2, 32, "v2", 96, 384, 0, 50, 6.49063),
        InstanceType("inf2.48xlarge", "inferentia2", 12, 2, 32, "v2", 192, 768, 0, 100, 12.98127),
    )
}

TRAINING_TYPES: tuple[str, ...] = tuple(name for name, t in CATALOGUE.items() if t.trainium)


def instance(name: str) -> InstanceType:
    """Look up an instance type by name, with a helpful error."""
    try:
        return CATALOGUE[name]
    except KeyError:
        known = ", ".join(CATALOGUE)
        raise KeyError(f"unknown instance type {name!r}; known types: {known}") from None
