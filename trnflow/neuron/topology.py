"""The emulated instance's Neuron devices, in the shape `neuron-ls --json-output` prints."""

from __future__ import annotations

from typing import Any

from trnflow.specs.instances import GIB, InstanceType, instance


def torus_neighbours(device: int, devices: int) -> list[int]:
    """Devices linked to `device`: a 4x4 2D torus on 16-device instances, a ring below that.

    trn1.32xlarge lists device 0 as connected to 12, 3, 4 and 1 (up, left, down, right).
    """
    if devices == 16:
        row, col = divmod(device, 4)
        up, down = ((row - 1) % 4) * 4 + col, ((row + 1) % 4) * 4 + col
        left, right = row * 4 + (col - 1) % 4, row * 4 + (col + 1) % 4
        return [up, left, down, right]
    if devices == 1:
        return []
    ring = {(device - 1) % devices, (device + 1) % devices}
    return sorted(ring)


def neuron_ls(itype: str | InstanceType, processes: dict[int, list[dict[str, Any]]] | None = None) -> list[dict]:
    """One record per device, as `neuron-ls -j` gives it. `processes` maps device index to holders."""
    t = instance(itype) if isinstance(itype, str) else itype
    processes = processes or {}
    records = []
    for dev in range(t.chips):
        first = dev * t.cores_per_chip
        record: dict[str, Any] = {
            "neuron_device": dev,
            "bdf": f"{0x10 + dev:02x}:1e.0",
            "cpu_affinity": t.cpu_affinity(dev),
            "numa_node": str(t.numa_node(dev)),
            "connected_to": torus_neighbours(dev, t.chips),
            "nc_count": t.cores_per_chip,
            "memory_size": t.device_memory_gib * GIB,
            "neuroncore_ids": list(range(first, first + t.cores_per_chip)),
            "neuron_processes": processes.get(dev, []),
        }
        if t.device_type == "trainium2":
            record["logical_neuroncore_config"] = 2
        records.append(record)
    return records


def core_owners(itype: str | InstanceType, held: dict[int, dict]) -> dict[int, list[dict[str, Any]]]:
    """The processes holding each device's cores (`held`: core -> its holder's pid and command), in
    `neuron-ls -j`'s `neuron_processes` shape."""
    t = instance(itype) if isinstance(itype, str) else itype
    by_device: dict[int, dict[Any, dict[str, Any]]] = {}
    for core, holder in sorted(held.items()):
        device = core // t.cores_per_chip
        entry = by_device.setdefault(device, {}).setdefault(holder.get("pid"), {
            "pid": holder.get("pid"), "command": holder.get("command", "?"), "neuroncore_ids": []})
        entry["neuroncore_ids"].append(core)
    return {device: list(procs.values()) for device, procs in by_device.items()}
