"""The ahead-of-time compile phase: capture the training step's graphs, look their key up in the
persistent cache, and compile on a miss.

Compilation runs the compiled step forward and backward once, so the entry holds every kernel the
step needs; the Inductor cache directory it filled becomes the entry's artifact.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from trnflow.emulator import compiler
from trnflow.errors import FatalError
from trnflow.storage import local_path
from trnflow.workload.context import WorkerContext
from trnflow.workload.model import build_model


def _step_fn(model: torch.nn.Module, precision: str):
    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision != "fp32" else contextlib.nullcontext()
        with amp:
            logits = model(tokens)
        return F.cross_entropy(logits.float(), labels)

    return step


def run(ctx: WorkerContext) -> dict:
    spec = ctx.spec
    cache_root = local_path(spec.compile.cache_url)
    print(f"INFO ||NEURON_CACHE||: Compile cache path: {cache_root}", flush=True)
    model = build_model(spec.model, spec.train.seed)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(2, spec.model.vocab_size, (spec.per_core_batch, spec.model.seq_len), generator=gen)
    labels = torch.randint(0, spec.model.num_classes, (spec.per_core_batch,), generator=gen)
    step = _step_fn(model, spec.compute.precision)

    graphs = compiler.capture_graphs(step, tokens, labels)
    flags = compiler.compile_flags(spec.compile.optlevel, spec.compute.precision)
    key = compiler.cache_key(graphs, flags)
    entry = compiler.entry_dir(cache_root, key)
    state = compiler.entry_state(entry)
    result = {"key": key, "entry": entry.as_uri(), "graphs": len(graphs), "flags": flags}
    if state == "done":
        print(f"INFO ||NCC_WRAPPER||: Using a cached neff at {entry / 'model.neff'}. "
              "Exiting with a successfully compiled graph.", flush=True)
        return {**result, "hit": True, "compiled": 0, "seconds": 0.0}
    if state == "failed":
        raise FatalError(f"{entry}: this graph failed to compile before (see model.log); "
                         "fix the model or clear the failed entry to recompile")

    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trnflow-inductor-") as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
        try:
            torch._dynamo.reset()
            compiled = torch.compile(step, mode=flags["mode"])
            compiled(tokens, labels).backward()
        except Exception as exc:
            compiler.record_failure(entry, graphs, flags, traceback.format_exc())
            raise FatalError(f"compilation of {key} failed: {type(exc).__name__}: {exc}") from None
        artifact = compiler.pack_dir(Path(tmp))
    compiler.commit_entry(entry, graphs, flags, artifact)
    seconds = time.perf_counter() - began
    print(f"INFO ||NEURON_PARALLEL_COMPILE||: Total graphs: {len(graphs)}; compiled {key} "
          f"in {seconds:.1f}s", flush=True)
    return {**result, "hit": False, "compiled": 1, "seconds": round(seconds, 3),
            "artifact_bytes": len(artifact)}
