"""The `xla` device: torch-xla lazy tensors, the legacy torch-neuronx path that trn1 fleets run, and,
with `PJRT_DEVICE=CPU`, a local rehearsal of it on torch-xla's CPU runtime.

On a lazy device the program is traced as it runs and compiled where it synchronises: after backward
and after the optimizer step (`sync`), and where a result is read on the host. So `compile` leaves a
function as it is, and the compile backend (`XlaGraphs`) watches which graphs the runtime compiles.
It learns them from a private persistent-cache folder that this process's runtime writes each
compiled executable into, named by the graph's hash: every new file is one compiled graph.

Each graph is filed in the spec's compile cache as `MODULE_<graph hash>+<flags hash>`, like the
emulator's. Ahead-of-time compilation traces the trial steps and records each graph there (with
its serialized executable as the artifact); a run counts every graph whose entry is missing as a
recompilation, so `compile.max_recompiles` and `trnflow compile --check` mean the same as on the
emulator. torch-xla's CPU runtime cannot load a serialized executable back (it reports
"Deserializing serialized executable not supported"), so there a cached graph is still compiled
again: the cache is the index of graphs a run may meet. On Trainium the Neuron compiler keeps its
own artifacts in the cache folder that `NEURON_CC_FLAGS=--cache_dir=...` names, which this device
sets to the spec's cache when the flags do not name one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch_xla
import torch_xla.debug.metrics as xla_metrics
import torch_xla.runtime as xla_runtime

from trnflow.device.base import Device, Log, RecompileGuard
from trnflow.device.cache import CompileCache
from trnflow.device.indexed import IndexedGraphs
from trnflow.neuron.launch import cache_url
from trnflow.safetar import pack
from trnflow.specs import JobSpec
from trnflow.storage.base import local_path


class Journal:
    """The folder this process's runtime writes each compiled executable into, by graph hash."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="trnflow-xla-graphs-"))
        atexit.register(shutil.rmtree, self.path, ignore_errors=True)
        xla_runtime.initialize_cache(str(self.path), readonly=False)  # before the runtime compiles anything
        self.known: set[str] = set()

    def new(self) -> list[str]:
        """The graphs compiled since the last call, oldest first."""
        fresh = sorted((p for p in self.path.iterdir() if p.name not in self.known), key=lambda p: p.stat().st_mtime_ns)
        self.known |= {p.name for p in fresh}
        return [p.name for p in fresh]


def compile_seconds() -> float:
    """Seconds the runtime has spent compiling in this process."""
    data = xla_metrics.metric_data("CompileTime")
    return data[1] / 1e9 if data else 0.0


@dataclass
class XlaGraphs(IndexedGraphs):
    """The compile backend of the `xla` device: the graphs come from the process's journal."""

    journal: Journal | None = None
    _seconds: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        assert self.journal is not None
        self.journal.new()  # graphs compiled before this backend existed are not its own
        self._seconds = compile_seconds()

    def observe(self) -> None:
        assert self.journal is not None
        fresh = self.journal.new()
        if not fresh:
            return
        now = compile_seconds()
        seconds, self._seconds = (now - self._seconds) / len(fresh), now
        for graph_hash in fresh:
            self.file(graph_hash, seconds, (self.journal.path / graph_hash).read_bytes)


def neuron_cc_flags(cache: str, env: dict[str, str]) -> str:
    """NEURON_CC_FLAGS with the persistent cache folder set to `cache`, unless the flags name one."""
    flags = env.get("NEURON_CC_FLAGS", "")
    if "--cache_dir" in flags:
        return flags
    where = str(local_path(cache)) if urlparse(cache).scheme in ("", "file") else cache
    return f"{flags} --cache_dir={where}".strip()


class XlaDevice(Device):
    name = "xla"
    process_group_backend = "xla"
    init_method = "xla://"

    def __init__(self) -> None:
        self._journal: Journal | None = None
        self._backend: XlaGraphs | None = None

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            self._journal = Journal()
        return self._journal

    @property
    def torch_device(self) -> torch.device:
        self.journal  # noqa: B018 - the journal must exist before the runtime starts
        return torch_xla.device()

    def init_process_group(self, world_size: int, timeout_seconds: float) -> None:
        if world_size > 1:
            import torch_xla.distributed.xla_backend  # noqa: F401  # optional: registers the "xla" backend
        super().init_process_group(world_size, timeout_seconds)

    def compiler(self, spec: JobSpec, mode: str = "run", log: Log | None = None,
                 workdir: Path | None = None) -> XlaGraphs:
        url = cache_url(spec.compile.cache_url)
        os.environ["NEURON_CC_FLAGS"] = neuron_cc_flags(url, os.environ)
        flags = {"backend": "xla", "torch_xla": torch_xla.__version__, "runtime": xla_runtime.device_type(),
                 "optlevel": spec.compile.optlevel, "precision": spec.compute.precision}
        self._backend = XlaGraphs(flags, CompileCache(url) if mode == "run" else None, mode,
                                  RecompileGuard(spec.compile.recompile_limit), workdir,
                                  log or (lambda event, **fields: None), journal=self.journal)
        return self._backend

    def artifact(self, workdir: Path) -> bytes:
        return pack(workdir)

    def compile(self, fn: Callable, backend: Any) -> Callable:
        """Lazy tensors are traced as they run and compiled where they synchronise: `fn` as it is."""
        return fn

    def inference(self) -> contextlib.AbstractContextManager:
        return torch.no_grad()  # torch-xla's tensors cannot be inference tensors

    def sync(self) -> None:
        torch_xla.sync()
        if self._backend is not None:
            self._backend.observe()
