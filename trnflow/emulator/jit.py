"""The `torch.compile` backend every program runs through: cache lookups, warm loads, the
recompilation guard, and graph extraction.

One `CachedCompiler` per process. TorchDynamo hands it each graph it traces; what happens next
depends on the mode:

- `extract`: the graph and its key are recorded and the graph runs eagerly (nothing is compiled),
  like a script run under neuron_parallel_compile's extraction;
- `compile`: the graph is lowered with the real compiler into this process's Inductor cache
  folder, which the compile worker then packs into the persistent cache;
- `run`: a graph whose key is in the persistent cache is a hit: its artifact (the Inductor cache
  it was built into) is unpacked into this process's private Inductor folder, so lowering finds
  the kernels already built (at O1, which builds none, the captured graph runs: `runnable`). Any
  other graph is a recompilation: counted, logged with its shapes, and fatal when
  `fail_on_recompile` is set.

The private Inductor folder (TORCHINDUCTOR_CACHE_DIR) keeps a machine-wide Inductor cache from
making a cold compile look warm, or a miss look like a hit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trnflow.device.base import CompilerSettings, Seen
from trnflow.device.cache import CorruptEntry, UnsignedEntry, entry_name, miss_reason
from trnflow.emulator.compiler import Graph, cache_key, lower, runnable, unpack_into


@dataclass
class CachedCompiler(CompilerSettings):
    inductor_dir: Path | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.inductor_dir is not None:
            self.inductor_dir.mkdir(parents=True, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.inductor_dir)

    @contextlib.contextmanager
    def naming(self, program: str, *inputs: Any) -> Iterator[None]:
        """Graphs traced inside are attributed to `program` (their inputs come with each graph)."""
        before, self.program = self.program, program
        try:
            yield
        finally:
            self.program = before

    def __call__(self, gm: Any, example_inputs: list) -> Callable:
        graph = Graph.of(gm, example_inputs)
        key = cache_key(graph, self.flags)
        if self.mode == "extract":
            self.seen.append(Seen(self.program, key, graph, "extracted"))
            return gm.forward
        began = time.perf_counter()
        if self.mode == "compile":
            keep = self.inductor_dir if self.flags["backend"] != "inductor" else None
            compiled = lower(gm, example_inputs, self.flags, keep_graphs=keep)
            self.seen.append(Seen(self.program, key, graph, "compiled", seconds=time.perf_counter() - began))
            return compiled
        reason = self._load(key, graph)
        compiled = runnable(gm, example_inputs, self.flags)
        seen = Seen(self.program, key, graph, "hit" if not reason else "recompiled", reason,
                    time.perf_counter() - began)
        self.seen.append(seen)
        if reason:
            self.log("recompile", program=self.program, key=key, reason=reason, shapes=graph.data_shapes,
                     seconds=round(seen.seconds, 3))
        else:
            self.log("compile_cache_hit", program=self.program, key=key, seconds=round(seen.seconds, 3))
        return compiled

    def _load(self, key: str, graph: Graph) -> str:
        """Unpack the key's artifact for the compiler to find; '' on a hit, else why it missed.

        Raises Recompilation on a miss over the guard's limit."""
        entry, reason = entry_name(key), ""
        try:  # one read, checked against trnflow.json: an entry that is not whole is never loaded
            artifact = self.cache.load_artifact(entry) if self.cache else None
        except UnsignedEntry as exc:  # not the compile stage's: never unpacked
            artifact, reason = None, f"the cache entry is not used: {exc}"
        except CorruptEntry:
            artifact = None
        if artifact is not None and self.inductor_dir is not None:
            try:
                unpack_into(artifact, self.inductor_dir)
            except CorruptEntry as exc:  # its checksums match, but what they cover is no archive
                artifact, reason = None, f"the cache entry is corrupt ({exc})"
        if artifact is not None:
            self.cache.record_hit(entry)
        elif not reason:  # only a miss pays for finding out why
            reason = miss_reason(self.cache, entry)
        if reason:
            where = self.cache.url if self.cache else "the compile cache"
            self.guard.recompiled(self.program, key, graph.data_shapes, reason, where)
        return reason

