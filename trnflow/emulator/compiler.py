"""The emulator's compiler and its persistent cache, laid out like the Neuron persistent cache.

The compiler is TorchInductor (`torch.compile`); the torch version stands for the compiler
version. A cache entry lives at

    <cache>/torch-<version>/MODULE_<graph hash>+<flags hash>/
        model.fx.txt         the canonical graph (what the key was computed from)
        compile_flags.json   the compiler flags
        model.neff           the compiled artifact: the Inductor cache directory, as a tar.gz
        model.done           written last; holds the artifact's sha256
        model.log            instead of model.neff + model.done when compilation failed

The key is a pure function of the graph's code, its input shapes and dtypes, the flags and the
compiler version, so the same model and spec give the same key on any host.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trnflow.fsutil import atomic_write_bytes, atomic_write_json, atomic_write_text

COMPILER_VERSION = f"torch-{torch.__version__}"

# optlevel -> torch.compile mode. O1 favours compile time, O3 spends it on autotuning.
OPTLEVEL_MODES = {1: "default", 2: "default", 3: "max-autotune-no-cudagraphs"}


@dataclass(frozen=True)
class Graph:
    """One captured graph: its generated code and the shapes and dtypes it was traced with."""

    code: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]

    def canonical(self) -> str:
        shapes = "\n".join(f"input {i}: {list(s)} {d}" for i, (s, d) in enumerate(self.inputs))
        return f"{self.code.strip()}\n# inputs\n{shapes}\n"


def compile_flags(optlevel: int, precision: str) -> dict:
    return {"optlevel": optlevel, "precision": precision, "mode": OPTLEVEL_MODES[optlevel]}


def cache_key(graphs: list[Graph], flags: dict) -> str:
    """`MODULE_<graph hash>+<flags hash>`, as the Neuron cache names its entries."""
    graph_hash = hashlib.sha256("\n".join(g.canonical() for g in graphs).encode()).hexdigest()[:20]
    flags_hash = hashlib.md5(json.dumps(flags, sort_keys=True).encode(), usedforsecurity=False).hexdigest()[:8]
    return f"MODULE_{graph_hash}+{flags_hash}"


def entry_dir(cache_root: Path, key: str) -> Path:
    return cache_root / COMPILER_VERSION / key


def entry_state(entry: Path) -> str:
    """"done", "failed" or "missing"; a done marker whose checksum does not match counts as missing."""
    done = entry / "model.done"
    if done.is_file() and (entry / "model.neff").is_file():
        expected = json.loads(done.read_text()).get("sha256")
        actual = hashlib.sha256((entry / "model.neff").read_bytes()).hexdigest()
        return "done" if expected == actual else "missing"
    if (entry / "model.log").is_file():
        return "failed"
    return "missing"


def capture_graphs(fn, *args) -> list[Graph]:
    """Run `fn(*args)` under TorchDynamo with a recording backend: every graph it would compile."""
    graphs: list[Graph] = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        inputs = tuple(
            (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for t in example_inputs
            if isinstance(t, torch.Tensor)
        )
        graphs.append(Graph(gm.code, inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=False)(*args)
    torch._dynamo.reset()
    return graphs


def pack_dir(path: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for child in sorted(path.rglob("*")):
            tar.add(child, arcname=str(child.relative_to(path)), recursive=False)
    return buf.getvalue()


def commit_entry(entry: Path, graphs: list[Graph], flags: dict, artifact: bytes) -> None:
    """Write a successful entry; `model.done` goes last."""
    atomic_write_text(entry / "model.fx.txt", "\n".join(g.canonical() for g in graphs))
    atomic_write_json(entry / "compile_flags.json", flags)
    (entry / "model.log").unlink(missing_ok=True)
    atomic_write_bytes(entry / "model.neff", artifact)
    atomic_write_json(entry / "model.done", {"sha256": hashlib.sha256(artifact).hexdigest()})


def record_failure(entry: Path, graphs: list[Graph], flags: dict, log: str) -> None:
    atomic_write_text(entry / "model.fx.txt", "\n".join(g.canonical() for g in graphs))
    atomic_write_json(entry / "compile_flags.json", flags)
    atomic_write_text(entry / "model.log", log)
