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
A graph that fails to compile is an error, never a silent fall back to eager
(`TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1` unless set).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch_neuronx
from torch_neuronx import neuron_dynamo_backend

from trnflow.device.base import Device, Log, RecompileGuard
from trnflow.device.cache import CompileCache
from trnflow.device.indexed import IndexedGraphs
from trnflow.neuron.launch import cache_url
from trnflow.safetar import pack
from trnflow.specs import JobSpec
from trnflow.storage.base import local_path

BACKEND = "neuron"
"""The `torch.compile` backend torch-neuronx registers."""


def settings(cache: str, env: dict[str, str]) -> dict[str, str]:
    """The TORCH_NEURONX_* variables a job runs with, those already set left as they are."""
    wanted = {"TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION": "1"}
    if urlparse(cache).scheme in ("", "file"):  # the native cache is a folder; with an S3 cache it keeps its own
        wanted["TORCH_NEURONX_NEFF_CACHE_DIR"] = str(local_path(cache) / "neff")
    return {k: v for k, v in wanted.items() if k not in env}


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


class NeuronDevice(Device):
    name = "neuron"
    process_group_backend = "neuron"

    @property
    def torch_device(self) -> torch.device:
        """This rank's core: `neuron:<local rank>` when the process sees its group's cores, else `neuron:0`."""
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(BACKEND, local if local < torch.neuron.device_count() else 0)

    def compiler(self, spec: JobSpec, mode: str = "run", log: Log | None = None,
                 workdir: Path | None = None) -> NeuronGraphs:
        url = cache_url(spec.compile.cache_url)
        os.environ.update(settings(url, os.environ))
        flags = {"backend": BACKEND, "torch_neuronx": torch_neuronx.__version__, "optlevel": spec.compile.optlevel,
                 "precision": spec.compute.precision}
        return NeuronGraphs(flags, CompileCache(url) if mode == "run" else None, mode,
                            RecompileGuard(spec.compile.recompile_limit), workdir,
                            log or (lambda event, **fields: None))

    def artifact(self, workdir: Path) -> bytes:
        return pack(workdir)

    def compile(self, fn: Callable, backend: Any) -> Callable:
        return torch.compile(fn, backend=BACKEND, fullgraph=True, dynamic=False)

    def inference(self) -> contextlib.AbstractContextManager:
        return torch.no_grad()
