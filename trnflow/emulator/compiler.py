"""The emulator's compiler: graph capture, cache keys and compiler flags.

The compiler is TorchInductor (`torch.compile`); the torch version stands for the compiler
version. A compiled artifact is the Inductor cache directory the compilation filled, as a tar.gz
(it holds the generated kernels and the built shared objects). See `cache.py` for where it goes.

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

COMPILER_VERSION = f"torch-{torch.__version__}"

# optlevel -> how the emulator compiles, trading compile time against step time as neuronx-cc's
# -O1/-O2/-O3 do. O1 lowers each graph to ATen forward and backward graphs (AOT autograd) without
# generating code: seconds to compile, eager speed. O2 generates fused C++ kernels with Inductor.
# O3 also autotunes them: the longest compile.
OPTLEVELS = {
    1: {"backend": "aot_eager", "mode": None},
    2: {"backend": "inductor", "mode": "default"},
    3: {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
}


@dataclass(frozen=True)
class Graph:
    """One captured graph: its generated code and the shapes and dtypes it was traced with."""

    code: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]

    def canonical(self) -> str:
        shapes = "\n".join(f"input {i}: {list(s)} {d}" for i, (s, d) in enumerate(self.inputs))
        return f"{self.code.strip()}\n# inputs\n{shapes}\n"


def compile_flags(optlevel: int, precision: str) -> dict:
    return {"optlevel": optlevel, "precision": precision, **OPTLEVELS[optlevel]}


def compiled_fn(fn, flags: dict, artifact_dir: Path):
    """`fn` compiled as `flags` say. Whatever the compiler produces lands in `artifact_dir`: for
    Inductor its cache (kernels and built objects, via TORCHINDUCTOR_CACHE_DIR, which the caller
    points there), for O1 the lowered forward and backward graphs."""
    if flags["backend"] == "inductor":
        return torch.compile(fn, mode=flags["mode"])
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    lowered = {"n": 0}

    def keep(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        lowered["n"] += 1
        (artifact_dir / f"graph-{lowered['n']:02d}.py").write_text(gm.code)
        return make_boxed_func(gm.forward)

    return torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))


def cache_key(graphs: list[Graph], flags: dict) -> str:
    """`MODULE_<graph hash>+<flags hash>`, as the Neuron cache names its entries."""
    graph_hash = hashlib.sha256("\n".join(g.canonical() for g in graphs).encode()).hexdigest()[:20]
    flags_hash = hashlib.md5(json.dumps(flags, sort_keys=True).encode(), usedforsecurity=False).hexdigest()[:8]
    return f"MODULE_{graph_hash}+{flags_hash}"


def entry_dir(cache_root: Path, key: str) -> Path:
    return cache_root / COMPILER_VERSION / key


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
