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
own artifacts where `NEURON_CC_FLAGS=--cache_dir=...` says: the spec's compile cache, as every
backend's launcher sets it (and this device, for a process started without it). Where the SDK's
`neuron_parallel_compile` is on PATH, ahead-of-time compilation first runs the trial under it, so
the Neuron compiler builds every graph in parallel before trnflow records them. One rank for now
(`trnflow validate` says so): DDP's all-reduce is part of a multi-rank step's graph.
"""

from __future__ import annotations

import atexit
import os
import shlex
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch_xla
import torch_xla.debug.metrics as xla_metrics
import torch_xla.runtime as xla_runtime

from trnflow.device.base import Log, RecompileGuard
from trnflow.device.cache import CompileCache
from trnflow.device.indexed import IndexedGraphs, RuntimeDevice
from trnflow.errors import FatalError
from trnflow.measures import ParallelCompile
from trnflow.neuron import tools
from trnflow.neuron.launch import cache_url, compiler_cache_dir
from trnflow.specs import JobSpec
from trnflow.specs.spec import XLA_FSDP


class Journal:
    """The folder this process's runtime writes each compiled executable into, by graph hash."""

    def __init__(self) -> None:
        if xla_metrics.metric_data("CompileTime"):
            raise FatalError("the xla device must be made before torch-xla compiles anything in the process: it "
                             "reads which graphs were compiled from the runtime's persistent cache")
        self.path = Path(tempfile.mkdtemp(prefix="trnflow-xla-graphs-"))
        atexit.register(shutil.rmtree, self.path, ignore_errors=True)
        xla_runtime.initialize_cache(str(self.path), readonly=False)
        self.known: set[str] = set()

    def new(self) -> list[str]:
        """The graphs compiled since the last call, oldest first."""
        fresh = sorted((p for p in self.path.iterdir() if p.name not in self.known),
                       key=lambda p: (p.stat().st_mtime_ns, p.name))
        self.known |= {p.name for p in fresh}
        data = xla_metrics.metric_data("CompileTime")
        compiles = data[0] if data else 0
        if len(self.known) < compiles:  # the runtime compiled a graph it did not write down
            raise FatalError(f"torch-xla compiled {compiles} graphs but its persistent cache at {self.path} holds "
                             f"{len(self.known)}: another persistent cache was set up first "
                             "(XLA_PERSISTENT_CACHE_PATH?); the recompile guard cannot work without it")
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
        if self.mode != "trial":
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


def compiler_options(flags: str) -> str:
    """NEURON_CC_FLAGS without the cache folder (where, not what, it compiles) and the optimisation
    level (the spec's, in the key on its own): what else shapes the compiled code."""
    return " ".join(f for f in shlex.split(flags) if not f.startswith(("--cache_dir", "--optlevel", "-O")))


class XlaDevice(RuntimeDevice):
    name = "xla"
    process_group_backend = "xla"
    init_method = "xla://"

    def __init__(self) -> None:
        super().__init__()
        self._journal: Journal | None = None

    @property
    def journal(self) -> Journal:
        if self._journal is None:
            self._journal = Journal()
        return self._journal

    @property
    def torch_device(self) -> torch.device:
        self.journal  # noqa: B018 - the journal must exist before the runtime compiles
        return torch_xla.device()

    def flags(self, spec: JobSpec) -> dict:
        return {"backend": "xla", "torch_xla": torch_xla.__version__, "runtime": xla_runtime.device_type(),
                "optlevel": spec.compile.optlevel, "precision": spec.compute.precision,
                "neuron_cc_flags": compiler_options(os.environ.get("NEURON_CC_FLAGS", ""))}

    def settings(self, url: str, started_with: dict[str, str]) -> dict[str, str]:
        """The Neuron compiler's cache folder is the compile cache, as neuron_parallel_compile has it
        (every backend's launcher sets it so); a process started without it gets it here."""
        flags = started_with.get("NEURON_CC_FLAGS", "")
        if "--cache_dir" in flags:
            return {}
        return {"NEURON_CC_FLAGS": f"{flags} --cache_dir={compiler_cache_dir(url)}".strip()}

    def graphs(self, flags: dict, cache: CompileCache | None, mode: str, guard: RecompileGuard,
               workdir: Path | None, log: Log) -> XlaGraphs:
        return XlaGraphs(flags, cache, mode, guard, log, workdir=workdir, journal=self.journal)

    def compile(self, fn: Callable, backend: Any, whole: bool = True) -> Callable:
        """Lazy tensors are traced as they run and compiled where they synchronise: `fn` as it is."""
        return fn

    def shard(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> None:
        raise FatalError(XLA_FSDP)

    def precompile(self, spec: JobSpec, trial: list[str]) -> ParallelCompile | None:
        """On a host with the Neuron SDK's `neuron_parallel_compile`, the trial run under it, which
        compiles every graph the trial meets into the Neuron compiler's cache (the spec's compile
        cache, through NEURON_CC_FLAGS' --cache_dir), `compile.workers` at a time."""
        if tools.which(tools.PARALLEL_COMPILE) is None:
            return None
        env = {**os.environ, **self.settings(cache_url(spec.compile.cache_url), self._started_with)}
        return tools.parallel_compile(spec.compile.workers, trial, env)

    def runtime_sync(self) -> None:
        torch_xla.sync()
