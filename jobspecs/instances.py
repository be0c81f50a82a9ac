"""The catalogue of Trainium and Inferentia instance types: the one source of truth for topology.

Spec validation, the emulator's devices, memory checks and cost reports all read this table.

Prices live beside it in `PRICES`, one per (service, instance type): AWS Batch runs on EC2
instances and bills EC2's on-demand price, while SageMaker bills its own `ml.*` price for the same
hardware, which is higher. Each price says the region it is for and the day it was read, because
AWS prices differ by region and change; they are only a default, and a spec's
`compute.price_per_hour` wins over them.
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
    numa_nodes: int = 1
    """The host's NUMA nodes; the devices are split evenly between them, in index order."""

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

    def numa_node(self, device: int) -> int:
        """The NUMA node `device` hangs off, as neuron-ls reports it."""
        return device * self.numa_nodes // self.chips

    def cpu_affinity(self, device: int) -> str:
        """The host CPUs local to `device`, in neuron-ls's notation: its NUMA node's cores and their
        second hardware threads, which Linux numbers after every core's first (on trn1.32xlarge,
        `0-31,64-95` for the devices on node 0). Work fed from these CPUs avoids the cross-node hop."""
        cores = self.vcpus // 2
        per_node, node = cores // self.numa_nodes, self.numa_node(device)
        first = range(node * per_node, (node + 1) * per_node)
        return cpu_ranges([*first, *(cpu + cores for cpu in first)])


CATALOGUE: dict[str, InstanceType] = {
    t.name: t
    for t in (
        InstanceType("trn1.2xlarge", "trainium", 1, 2, 32, "v2", 8, 32, 0, 25),
        InstanceType("trn1.32xlarge", "trainium", 16, 2, 32, "v2", 128, 512, 8, 800, numa_nodes=2),
        InstanceType("trn1n.32xlarge", "trainium", 16, 2, 32, "v2", 128, 512, 16, 1600, numa_nodes=2),
        InstanceType("trn2.48xlarge", "trainium2", 16, 4, 96, "v3d", 192, 2048, 16, 3200, numa_nodes=2),
        InstanceType("inf2.xlarge", "inferentia2", 1, 2, 32, "v2", 4, 16, 0, 15),
        InstanceType("inf2.8xlarge", "inferentia2", 1, 2, 32, "v2", 32, 128, 0, 25),
        InstanceType("inf2.24xlarge", "inferentia2", 6, 2, 32, "v2", 96, 384, 0, 50),
        InstanceType("inf2.48xlarge", "inferentia2", 12, 2, 32, "v2", 192, 768, 0, 100, numa_nodes=2),
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


def cpu_ranges(cpus: list[int]) -> str:
    """CPU numbers in the kernel's list notation, as neuron-ls prints an affinity: `0-31,64-95`."""
    spans: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


SERVICES: tuple[str, ...] = ("ec2", "sagemaker")
"""Who bills the instances: `ec2` for the instances AWS Batch launches, `sagemaker` for training
jobs, which SageMaker bills at its own `ml.*` price."""
BILLED_BY = {"local": "ec2", "batch": "ec2", "sagemaker": "sagemaker"}
"""Whose price each backend's jobs are billed at (`compute.backend` -> service): Batch launches EC2
instances; the emulator's jobs are priced as the EC2 instances the spec names."""


@dataclass(frozen=True, slots=True)
class Price:
    """One on-demand Linux price, with where and when it held: a figure without its region and date
    cannot be checked against the price list, nor noticed when it is stale."""

    service: str
    """"ec2" or "sagemaker"."""
    instance_type: str
    """The catalogue's (EC2) name, also for SageMaker, which bills it as `ml.<name>`."""
    usd_per_hour: float
    region: str
    as_of: str
    """The day the figure was read from the service's price list (YYYY-MM-DD)."""

    @property
    def billed_as(self) -> str:
        """The instance type as the service's bill names it."""
        return f"ml.{self.instance_type}" if self.service == "sagemaker" else self.instance_type


PRICES: dict[tuple[str, str], Price] = {
    (p.service, p.instance_type): p
    for p in (
        Price("ec2", "trn1.2xlarge", 1.34375, "us-east-1", "2026-08-26"),
        Price("ec2", "trn1.32xlarge", 21.50, "us-east-1", "2026-08-26"),
        Price("ec2", "trn1n.32xlarge", 24.78, "us-east-1", "2026-01-21"),
        # The only on-demand listing of trn2.48xlarge found was us-east-2's (Ohio), where trn2 launched.
        Price("ec2", "trn2.48xlarge", 35.76, "us-east-2", "2025-11-30"),
        Price("ec2", "inf2.xlarge", 0.7582, "us-east-1", "2026-08-26"),
        Price("ec2", "inf2.8xlarge", 1.96786, "us-east-1", "2026-08-26"),
        Price("ec2", "inf2.24xlarge", 6.49063, "us-east-1", "2026-08-26"),
        Price("ec2", "inf2.48xlarge", 12.98127, "us-east-1", "2026-08-26"),
        # SageMaker training: 15% above EC2 for the same hardware. ml.trn2.48xlarge has no
        # reliable public on-demand figure, so it has no entry: its cost shows as unknown.
        Price("sagemaker", "trn1.2xlarge", 1.54531, "us-east-1", "2026-11-25"),
        Price("sagemaker", "trn1.32xlarge", 24.725, "us-east-1", "2026-11-25"),
        Price("sagemaker", "trn1n.32xlarge", 28.497, "us-east-1", "2026-11-25"),
    )
}


def instance_cost(price_per_hour: float, nodes: int, seconds: float) -> float:
    """US dollars for `nodes` instances at `price_per_hour` each, held for `seconds`: the one pricing
    formula, the cost table's and a training job's budget check's."""
    return price_per_hour * nodes * seconds / 3600


def price(service: str, name: str) -> Price | None:
    """The on-demand price `service` bills for instance type `name`; None where no reliable
    figure is known (the cost table then says so, and `compute.price_per_hour` can give one)."""
    if service not in SERVICES:
        raise KeyError(f"unknown service {service!r}; known services: {', '.join(SERVICES)}")
    return PRICES.get((service, instance(name).name))
