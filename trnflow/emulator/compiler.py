"""The emulator's compiler: graphs, cache keys, compiler flags and lowering.

The compiler is TorchInductor; the torch version stands for the compiler version. A graph is one
TorchDynamo graph: the whole of a program, traced with `fullgraph=True` and static shapes. Its
key is a pure function of the graph's code, its inputs' shapes and dtypes, the grad and autocast
modes it was traced in and the compiler flags, and its entry is filed under the compiler version
(`cache.entry_name`), so the same model and spec find the same entry on any host.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trnflow.device.cache import CorruptEntry, module_key
from trnflow.device.private_torch import checkpoint_context, checkpoint_operator
from trnflow.safetar import Refused, unpack

# optlevel -> how the emulator compiles, trading compile time against step time as neuronx-cc's
# -O1/-O2/-O3 do. O1 lowers each graph to ATen forward and backward graphs (AOT autograd) without
# generating code: seconds to compile, eager speed (see `runnable`). O2 generates fused C++ kernels
# with Inductor. O3 also autotunes them: the longest compile.
OPTLEVELS = {
    1: {"backend": "aot_eager", "mode": None},
    2: {"backend": "inductor", "mode": "default"},
    3: {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"},
}


@dataclass(frozen=True)
class Input:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = ""
    """Of a split or sharded weight (a DTensor): its placements, the mesh's shape and this rank's part
    (`Shard(dim=0) of (2,): [32, 64]`), which the code it compiles to depends on."""

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> Input:
        layout = ""
        if isinstance(t, DTensor):
            placements = ", ".join(map(str, t.placements))
            layout = f"{placements} of {tuple(t.device_mesh.shape)}: {list(t.to_local().shape)}"
        return cls(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), layout)

    @property
    def is_state(self) -> bool:
        """A parameter or buffer of the model (lifted into the graph), not data."""
        return "_parameters_" in self.name or "_buffers_" in self.name

    def __str__(self) -> str:
        name = self.name.removeprefix("l_").removesuffix("_")  # Dynamo's l_tokens_ is the argument `tokens`
        return f"{name} {list(self.shape)} {self.dtype}" + (f" ({self.layout})" if self.layout else "")


@dataclass(frozen=True)
class Graph:
    """One captured graph: its code, its inputs, and the modes it was traced in."""

    code: str
    inputs: tuple[Input, ...]
    grad: bool
    autocast: str | None

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, example_inputs: list) -> Graph:
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        inputs = tuple(Input.of(name, t) for name, t in zip(names, example_inputs, strict=False)
                       if isinstance(t, torch.Tensor))
        autocast = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") \
            if torch.is_autocast_enabled("cpu") else None
        return cls(gm.code + _bodies(gm), inputs, torch.is_grad_enabled(), autocast)

    @property
    def data_shapes(self) -> str:
        """The data inputs' shapes, as a person reads them: `tokens [8, 32] int64`."""
        return ", ".join(str(i) for i in self.inputs if not i.is_state) or "no data inputs"

    def canonical(self) -> str:
        inputs = "\n".join(f"# input {i}: {x}" for i, x in enumerate(self.inputs))
        return (f"{self.code.strip()}\n# grad: {self.grad}\n# autocast: {self.autocast}\n{inputs}\n")


def _bodies(gm: torch.fx.GraphModule) -> str:
    """The graphs a captured graph calls through higher-order operators (a recomputed block's body),
    each with what it keeps under selective recomputation: its code says only their names."""
    parts = []
    for name, body in sorted(gm.named_modules()):
        if body is gm or not isinstance(body, torch.fx.GraphModule):
            continue
        context = checkpoint_context(body)
        keeps = f" (recomputed; {getattr(context, 'trnflow_policy', type(context).__name__)})" if context else ""
        parts.append(f"\n# body {name}{keeps}\n{body.code.strip()}")
    return "".join(parts)


def compile_flags(optlevel: int, precision: str) -> dict:
    return {"optlevel": optlevel, "precision": precision, **OPTLEVELS[optlevel]}


def cache_key(graph: Graph, flags: dict) -> str:
    """`MODULE_<graph hash>+<flags hash>`, as the Neuron cache names its entries."""
    return module_key(hashlib.sha256(graph.canonical().encode()).hexdigest()[:20], flags)


LOWERING_IMPORTS = {"inductor": ["torch._inductor", "torch._inductor.compile_fx"],
                    "aot_eager": ["functorch.compile", "torch._dynamo.backends.common"]}
"""What `lower` imports for each backend: a process that will lower graphs can load them ahead."""


def lower(gm: torch.fx.GraphModule, example_inputs: list, flags: dict, keep_graphs: Path | None = None):
    """Compile one graph as `flags` say. Inductor reads and fills its cache in
    TORCHINDUCTOR_CACHE_DIR (kernels and built objects); O1 writes its lowered forward and backward
    graphs to `keep_graphs` when given."""
    if flags["backend"] == "inductor":
        # Inductor and AOT autograd take seconds to import: only a process that lowers a graph loads them.
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=list_mode_options(flags["mode"]))
    # AOT autograd takes seconds to import: only a process that lowers a graph loads it.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    lowered = {"n": 0}

    def keep(graph: torch.fx.GraphModule, inputs: list) -> object:
        lowered["n"] += 1
        if keep_graphs is not None:
            (keep_graphs / f"graph-{lowered['n']:02d}.py").write_text(graph.code)
        return make_boxed_func(graph.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)(gm, example_inputs)


def runnable(gm: torch.fx.GraphModule, example_inputs: list, flags: dict):
    """What a run executes for a graph it took from the cache (or recompiled). At O2 and O3, the
    Inductor kernels. At O1, the captured graph itself, under eager autograd: O1 generates no
    code, and its lowered ATen graphs, run op by op from Python, take about 15% longer a training
    step on a CPU than the same maths run eagerly; but a graph whose blocks recompute their
    activations (`train.activation_checkpointing`) runs its lowered graphs too: outside AOT
    autograd, the captured checkpoint operator recomputes without replaying the random stream its
    dropout drew (AOT autograd's partitioner replays it). The cache lookup and the recompilation
    guard happen before this, whatever runs."""
    if flags["backend"] == "aot_eager" and not recomputes(gm):
        return gm.forward
    return lower(gm, example_inputs, flags)


def recomputes(gm: torch.fx.GraphModule) -> bool:
    """Whether the captured graph holds activation checkpointing's operator."""
    tagged = checkpoint_operator()
    return tagged is not None and any(node.target is tagged for node in gm.graph.nodes)


def unpack_into(artifact: bytes, path: Path) -> None:
    """Extract an artifact safely: regular files and folders only, nothing outside `path`.

    The whole archive is read and every member checked before anything is written; raises
    CorruptEntry when the artifact is not a readable gzipped tar of files and folders inside `path`."""
    try:
        with tarfile.open(fileobj=io.BytesIO(artifact), mode="r:gz") as tar:
            unpack(tar, path)
    except Refused as exc:  # safetar.pack writes files only: a link, a device or a path outside is none of ours
        raise CorruptEntry(f"its artifact holds an unsafe member, refused: {exc}") from None
    except (tarfile.TarError, gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise CorruptEntry(f"its artifact is not a readable archive: {exc}") from None


KERNELS = "*/*.so"
"""What Inductor builds with the C++ compiler, in its cache folder: each kernel
(`<2 characters>/<hash>.main.so`) and each probe of the CPU's vector instructions
(`<2 characters>/<hash>.so`), beside the `.cpp` it was built from. The hash covers the source and
the compiler command."""


def reuse_kernels(library: Path, workdir: Path) -> None:
    """Copy into `workdir` the kernels the compile job's earlier programs built (`keep_kernels`).
    Inductor looks for a kernel's binary before building it, so a kernel that two programs share (the
    forward pass's, in training, evaluation and inference alike) is built once per compile job. It
    writes a kernel's source beside the binary whenever a graph uses the kernel, so a copied binary
    left without its source was not used, and `drop_unused_kernels` takes it out again."""
    for binary in library.glob(KERNELS):
        target = workdir / binary.relative_to(library)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(binary, target)


def drop_unused_kernels(workdir: Path) -> None:
    """Remove the kernels `reuse_kernels` copied in that no graph of this program used: an artifact
    holds what its graphs run, nothing more."""
    for binary in workdir.glob(KERNELS):
        if not binary.with_suffix(".cpp").is_file():
            binary.unlink()


def keep_kernels(workdir: Path, library: Path) -> None:
    """Add the kernels built in `workdir` to the compile job's `library` (each whole, or not at all),
    for the job's next programs."""
    for binary in workdir.glob(KERNELS):
        target = library / binary.relative_to(workdir)
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            shutil.copyfile(binary, partial)
            os.replace(partial, target)
