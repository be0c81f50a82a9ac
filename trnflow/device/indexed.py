"""The compile backend of a device whose runtime compiles graphs itself (torch-xla, torch-neuronx):
it names the programs, learns from the runtime which graphs were compiled, and files each in the
spec's compile cache as `MODULE_<graph hash>+<flags hash>`, the way the emulator files its own.

- `extract`: each graph is recorded (a trial run of ahead-of-time compilation);
- `compile`: each graph is recorded and what the runtime keeps of it is written into the work
  folder, which becomes the cache entry's artifact;
- `run`: a graph whose entry is in the cache is a hit; any other is a recompilation, counted and
  refused over `compile.max_recompiles` by the same guard as on every device;
- `trial`: nothing is learned or filed (the trial run that the SDK's own parallel compiler wraps,
  which extracts and compiles the graphs itself).

A device subclasses `IndexedGraphs` with `observe`, which asks its runtime for new graphs and hands
each to `file`.
"""

from __future__ import annotations

import contextlib
import os
from abc import abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

import torch

from trnflow.device import plans
from trnflow.device.base import CompilerSettings, Device, Log, RecompileGuard, Seen
from trnflow.device.cache import DONE, CompileCache, entry_name, miss_reason, module_key
from trnflow.errors import FatalError
from trnflow.safetar import pack
from trnflow.specs import JobSpec
from trnflow.storage.base import local_path


def shapes_of(inputs: tuple) -> str:
    """A program's data inputs as a person reads them: `[8, 32] int64`."""
    return ", ".join(f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                     for t in inputs if isinstance(t, torch.Tensor)) or "no data inputs"


@dataclass(frozen=True)
class RuntimeGraph:
    """One graph the runtime compiled: its hash, and the program and inputs that traced it."""

    hash: str
    program: str
    data_shapes: str

    def canonical(self) -> str:
        return f"# runtime graph {self.hash}\n# program: {self.program}\n# inputs: {self.data_shapes}\n"


@dataclass
class IndexedGraphs(CompilerSettings):
    MODES: ClassVar[tuple[str, ...]] = ("extract", "compile", "run", "trial")

    workdir: Path | None = None
    shapes: dict[str, str] = field(default_factory=dict)

    def __call__(self, gm: Any, example_inputs: list) -> Callable:
        raise FatalError("this device's runtime compiles its own graphs: they do not pass through trnflow's backend")

    @contextlib.contextmanager
    def naming(self, program: str, *inputs: Any) -> Iterator[None]:
        """Graphs compiled inside (and, where the device compiles backward or a lazy step later, up to
        the next sync) are `program`'s, run on `inputs`."""
        self.program, self.shapes[program] = program, shapes_of(inputs)
        self.named(program)
        yield
        self.look()

    def look(self) -> None:
        """Learn the graphs compiled since the last look (not in a trial run)."""
        if self.mode != "trial":
            self.observe()

    def named(self, program: str) -> None:
        """Tell the runtime which program runs next (where it names its artifacts after it)."""

    def observe(self) -> None:
        """File each graph the runtime compiled since the last look."""
        raise NotImplementedError

    def file(self, graph_hash: str, seconds: float, kept: Callable[[], bytes]) -> None:
        """File one compiled graph; `kept` gives what the runtime keeps of it (the artifact)."""
        graph = RuntimeGraph(graph_hash, self.program, self.shapes.get(self.program, "no data inputs"))
        key = module_key(graph_hash, self.flags)
        if self.mode == "extract":
            self.seen.append(Seen(self.program, key, graph, "extracted", seconds=seconds))
        elif self.mode == "compile":
            assert self.workdir is not None
            (self.workdir / graph_hash).write_bytes(kept())
            self.seen.append(Seen(self.program, key, graph, "compiled", seconds=seconds))
        else:
            self._check(key, graph, seconds)

    def _check(self, key: str, graph: RuntimeGraph, seconds: float) -> None:
        entry = entry_name(key)
        if self.cache is not None and self.cache.state(entry) == DONE:
            self.cache.record_hit(entry)
            self.seen.append(Seen(graph.program, key, graph, "hit", seconds=seconds))
            self.log("compile_cache_hit", program=graph.program, key=key, seconds=round(seconds, 3))
            return
        reason = miss_reason(self.cache, entry)
        self.seen.append(Seen(graph.program, key, graph, "recompiled", reason, seconds))
        self.log("recompile", program=graph.program, key=key, reason=reason, shapes=graph.data_shapes,
                 seconds=round(seconds, 3))
        self.guard.recompiled(graph.program, key, graph.data_shapes, reason,
                              self.cache.url if self.cache else "the compile cache")


def is_local(url: str) -> bool:
    """Whether a cache URL names a folder on this machine (a path or file://)."""
    return urlparse(url).scheme in ("", "file")


def native_cache(url: str, folder: str) -> str:
    """Where a device's own compiler keeps its artifacts for the compile cache at `url`: `folder`
    inside it (a path for a local cache, a URL for S3), two levels below trnflow's entries so that
    listing and pruning trnflow's cache never touch them."""
    if is_local(url):
        return str(local_path(url) / folder)
    return f"{url.rstrip('/')}/{folder}"


class RuntimeDevice(Device):
    """A real device whose runtime compiles the programs: its compile backend (an `IndexedGraphs`)
    learns each graph at the syncs and as a program ends; autograd is turned off with no_grad;
    the cache artifact is what the backend kept in the work folder.

    The environment variables a device sets for its runtime (`settings`) are worked out from the
    environment as the process started, so a user's own values win and one spec's do not carry
    over to the next."""

    def __init__(self) -> None:
        self.backend: IndexedGraphs | None = None
        self._started_with = dict(os.environ)

    @abstractmethod
    def flags(self, spec: JobSpec) -> dict:
        """What decides the compiled code besides the graph (part of every cache key)."""

    @abstractmethod
    def graphs(self, flags: dict, cache: CompileCache | None, mode: str, guard: RecompileGuard,
               workdir: Path | None, log: Log) -> IndexedGraphs:
        """The device's compile backend."""

    def settings(self, url: str, started_with: dict[str, str]) -> dict[str, str]:
        """The runtime's environment variables for the compile cache at `url`."""
        return {}

    def compiler(self, spec: JobSpec, mode: str = "run", log: Log | None = None,
                 workdir: Path | None = None, model: str = "") -> IndexedGraphs:
        cache = plans.job_cache(spec)
        os.environ.update(self.settings(cache.url, self._started_with))
        flags = {**self.flags(spec), "model": model}
        self.backend = self.graphs(flags, cache if mode == "run" else None, mode,
                                   RecompileGuard(spec.compile.recompile_limit), workdir,
                                   log or (lambda event, **fields: None))
        return self.backend

    def artifact(self, workdir: Path) -> bytes:
        return pack(workdir)

    def inference(self) -> contextlib.AbstractContextManager:
        return torch.no_grad()  # inference tensors are not supported on every real device (torch-xla's)

    def runtime_sync(self) -> None:
        """Let the runtime run what it has queued or traced."""

    def sync(self) -> None:
        self.runtime_sync()
        if self.backend is not None:
            self.backend.look()
