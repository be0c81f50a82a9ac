"""The `neuron` device: native TorchNeuron (torch-neuronx from Neuron SDK 2.33, on trn2 and trn3).

`import torch_neuronx` registers the PrivateUse1 device `neuron` and the `neuron` process-group
backend. Programs compile with `torch.compile(fn, backend="neuron", fullgraph=True)` (dynamic shapes
are refused: every new shape is a new graph), mixed precision is `torch.autocast("neuron")`, and
ranks join with `init_process_group("neuron", init_method="env://")` under torchrun.

Which graphs a process compiled comes from the backend's helper API,
`torch_neuronx.neuron_dynamo_backend.get_dynamo_metrics()`: one entry per compiled graph, whose
`graph_id` is its cache key. Each is filed in the spec's compile cache as
`MODULE_<graph_id>+<flags hash>`, as on the other devices, so ahead-of-time compilation (which
warms the native NEFF cache by compiling one batch of each shape) and the recompile guard mean the
same here. The native NEFF cache goes where `TORCH_NEURONX_NEFF_CACHE_DIR` says; for a compile
cache in a local folder the device points it at `neff/` inside that folder unless it is set.
Ranks join one process group, `cpu:gloo,neuron:neuron`: the Neuron backend carries the device
tensors (DDP's gradient all-reduce), gloo the host tensors the workload gathers. DDP wraps the
compiled module, so its all-reduce stays outside the graphs and a graph is the same at every world
size: the one-process trial run of ahead-of-time compilation compiles what every rank runs.
A graph that fails to compile is an error, never a silent fall back to eager
(`TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1` unless set).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch_neuronx
from torch_neuronx import neuron_dynamo_backend

from trnflow.device.base import Log, RecompileGuard
from trnflow.device.cache import CompileCache
from trnflow.device.indexed import IndexedGraphs, RuntimeDevice, is_local, native_cache
from trnflow.specs import JobSpec

BACKEND = "neuron"
"""The `torch.compile` backend torch-neuronx registers."""


@dataclass
class NeuronGraphs(IndexedGraphs):
    """The compile backend of the `neuron` device: the graphs come from the Neuron backend's metrics."""

    _known: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        self._known = len(neuron_dynamo_backend.get_dynamo_metrics())  # earlier graphs are not this backend's

    def named(self, program: str) -> None:
        neuron_dynamo_backend.set_model_name(program)

    def observe(self) -> None:
        entries = neuron_dynamo_backend.get_dynamo_metrics()
        fresh, self._known = entries[self._known:], len(entries)
        for entry in fresh:
            record = {"graph_id": str(entry.graph_id), "graph_name": entry.graph_name,
                      "nodes": entry.graph_node_count, "compile_us": entry.torch_neuronx_compile_us}
            self.file(record["graph_id"], entry.torch_neuronx_compile_us / 1e6,
                      lambda r=record: json.dumps(r).encode())


class NeuronDevice(RuntimeDevice):
    name = "neuron"
    process_group_backend = "neuron"

    @property
    def torch_device(self) -> torch.device:
        """This rank's core: `neuron:<local rank>` when the process sees its group's cores, else `neuron:0`."""
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(BACKEND, local if local < torch.neuron.device_count() else 0)

    def flags(self, spec: JobSpec) -> dict:
        return {"backend": BACKEND, "torch_neuronx": torch_neuronx.__version__, "precision": spec.compute.precision}

    def settings(self, url: str, started_with: dict[str, str]) -> dict[str, str]:
        """A failed compile is an error (never a silent fall back to eager); the NEFF cache sits
        beside trnflow's entries for a local cache. A variable the user set stays as it is."""
        wanted = {"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1"}
        if is_local(url):  # torch-neuronx's NEFF cache is a folder
            wanted["TORCH_NEURONX_NEFF_CACHE_DIR"] = native_cache(url, "neff")
        return {k: v for k, v in wanted.items() if k not in started_with}

    def graphs(self, flags: dict, cache: CompileCache | None, mode: str, guard: RecompileGuard,
               workdir: Path | None, log: Log) -> NeuronGraphs:
        return NeuronGraphs(flags, cache, mode, guard, log, workdir=workdir)

    def compile(self, fn: Callable, backend: Any, whole: bool = True) -> Callable:
        return torch.compile(fn, backend=BACKEND, fullgraph=whole, dynamic=False)
