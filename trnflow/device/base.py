"""What the workload needs from a NeuronCore, whatever kind it is: the `Device` interface.

A device says which torch device tensors live on, how programs are compiled (the `torch.compile`
backend and its persistent cache), which process-group backend joins the ranks, how precision is
handled (autocast, bf16, stochastic rounding), where the program must synchronise, which cores
this process may use and how many graphs it compiled. The workload asks these questions and never
imports a device's implementation: `trnflow.device.registry` finds it by name.

Injected faults (the emulator's fault model) enter through `FaultHooks`. A device without a fault
model hands out `NoFaults`, whose hooks do nothing, so training code calls them unconditionally.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from trnflow.device.layout import TensorPlan
from trnflow.device.private_torch import fake_group
from trnflow.errors import FatalError, Recompilation
from trnflow.measures import GraphSeen, ParallelCompile
from trnflow.neuron.launch import aligned_ranges, parse_visible_cores
from trnflow.results import CompileMetrics
from trnflow.specs import JobSpec

if TYPE_CHECKING:
    from trnflow.device.cache import CompileCache

STOCHASTIC, NEAREST = "stochastic", "nearest"
"""The two ways a pure-bf16 run rounds its updated state onto the bf16 grid (`Device.rounding`)."""

Log = Callable[..., None]


@dataclass
class RecompileGuard:
    """The limit on recompilations in a run, the same on every device: each graph a run meets that
    was not compiled ahead of time (or in warm-up) is counted, and the one over `limit` stops the run
    with the shapes that caused it. `limit` None: count only."""

    limit: int | None = None
    count: int = 0

    def recompiled(self, program: str, key: str, shapes: str, reason: str, where: str) -> None:
        self.count += 1
        if self.limit is None or self.count <= self.limit:
            return
        raise Recompilation(
            f"{program} needs a graph that was not compiled ahead of time: {key} for inputs {shapes}; {reason} "
            f"({where}). That is recompilation {self.count}, over compile.max_recompiles ({self.limit}). Dynamic "
            "shapes are the usual cause: keep every batch the same shape (a fixed per-core batch with "
            "train.drop_last: true, and features of one shape per row from the recipe), then run `trnflow "
            "compile SPEC` so the cache holds every graph"
        )


@dataclass
class Seen:
    """One graph a compile backend met: which program traced it, its cache key, and what became of it."""

    program: str
    key: str
    graph: Any
    """The graph: its `data_shapes` (as a person reads them) and its `canonical()` text."""
    outcome: str
    """extracted, compiled, hit, or recompiled."""
    reason: str = ""
    seconds: float = 0.0

    def record(self) -> GraphSeen:
        return GraphSeen(program=self.program, key=self.key, outcome=self.outcome, reason=self.reason,
                         shapes=self.graph.data_shapes, seconds=round(self.seconds, 3))


def summarise(seen: list[Seen]) -> CompileMetrics:
    """What a process compiled, loaded from the cache and recompiled."""
    return CompileMetrics(graphs=len(seen), hits=sum(s.outcome == "hit" for s in seen),
                          recompiles=[s.record() for s in seen if s.outcome == "recompiled"],
                          seconds=round(sum(s.seconds for s in seen), 3))


@dataclass
class CompilerSettings:
    """What every device's compile backend is made with: the compiler flags its cache keys and
    artifacts come from, the cache it reads (or fills), its mode, the run's recompilation guard and
    log; and what it meets as it runs: the program being traced and each graph (`seen`)."""

    MODES: ClassVar[tuple[str, ...]] = ("extract", "compile", "run")

    flags: dict
    cache: CompileCache | None = None
    mode: str = "run"
    guard: RecompileGuard = field(default_factory=RecompileGuard)
    log: Log = field(default=lambda event, **fields: None)
    program: str = "program"
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in self.MODES:
            raise ValueError(f"unknown mode {self.mode!r}")

    def metrics(self) -> CompileMetrics:
        """What this process compiled, loaded from the cache and recompiled."""
        return summarise(self.seen)


class CompileBackend(Protocol):
    """A `torch.compile` backend that also names programs and counts what it compiled."""

    flags: dict
    """The compiler flags its cache keys and artifacts are made with."""
    seen: list
    """Each graph traced so far: its program, cache key, graph and outcome."""

    def __call__(self, gm: Any, example_inputs: list) -> Callable: ...

    def naming(self, program: str, *inputs: Any) -> contextlib.AbstractContextManager:
        """Graphs traced inside are `program`'s, run on `inputs` (its data, for the report of a recompile)."""

    def metrics(self) -> CompileMetrics: ...


class Lease(Protocol):
    cores: list[int]

    def release(self) -> None: ...


class FaultHooks(Protocol):
    """Where injected faults strike: a step, a result, a write, an engine's answer, a collective."""

    kinds: set[str]

    def strike(self, step: int, first_time: Callable[[Any], bool], phase: str = "train",
               settle: Callable[[], None] = ...) -> set[str]: ...

    def marker(self) -> bytes: ...

    def corrupt(self, t: torch.Tensor) -> torch.Tensor: ...

    def flip_bits(self, buf: torch.Tensor) -> None: ...

    def maybe_hang(self) -> None: ...

    def tearing(self, store: Any) -> Any: ...

    def begin_step(self, step: int, first_time: Callable[[Any], bool], settle: Callable[[], None] = ...) -> None:
        """Fire the faults due at training step `step`; `settle()` first (the checkpoint write in
        flight committed), when one is due."""

    def result(self, t: torch.Tensor) -> torch.Tensor: ...

    def checkpoint_store(self, checkpoints: Any, writer: bool) -> Any: ...

    def checkpoint_written(self) -> None: ...

    def slow_down(self, seconds: float) -> None:
        """A training step's own work took `seconds` on this core: a slow core takes longer still."""


class NoFaults:
    """The fault hooks of a device that injects none: each hook leaves things as they are."""

    kinds: set[str] = frozenset()  # type: ignore[assignment]

    def strike(self, step: int, first_time: Callable[[Any], bool], phase: str = "train",
               settle: Callable[[], None] | None = None) -> set[str]:
        return set()

    def marker(self) -> bytes:
        return f"pid {os.getpid()}".encode()

    def corrupt(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def flip_bits(self, buf: torch.Tensor) -> None:
        return None

    def maybe_hang(self) -> None:
        return None

    def tearing(self, store: Any) -> Any:
        return store

    def begin_step(self, step: int, first_time: Callable[[Any], bool], settle: Callable[[], None] | None = None
                   ) -> None:
        return None

    def result(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def slow_down(self, seconds: float) -> None:
        return None

    def checkpoint_store(self, checkpoints: Any, writer: bool) -> Any:
        return checkpoints

    def checkpoint_written(self) -> None:
        return None


class Device(ABC):
    """One kind of NeuronCore, as the workload sees it."""

    name: str
    process_group_backend: str
    """The `torch.distributed` backend that joins the ranks' device tensors (gloo, neuron, xla)."""
    init_method: str = "env://"

    @property
    @abstractmethod
    def torch_device(self) -> torch.device:
        """Where the model, its inputs and its optimizer state live."""

    def visible_cores(self, env: dict[str, str] | None = None) -> list[int]:
        """The cores this process group may use, from NEURON_RT_VISIBLE_CORES (all local ranks' by default)."""
        env = os.environ if env is None else env
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        return parse_visible_cores(env.get("NEURON_RT_VISIBLE_CORES", f"0-{local_world - 1}"))

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """`t` where the programs run (the same tensor when it is there already)."""
        return t.to(self.torch_device)

    def inference(self) -> contextlib.AbstractContextManager:
        """No autograd, for evaluation and embedding: inference mode, where the device supports it
        (torch-xla's tensors do not)."""
        return torch.inference_mode()

    def to_host(self, tree: Any) -> Any:
        """A state dict (or any nest of dicts, lists and tensors) with its tensors in host memory, as
        checkpoints are saved and outputs are written; tensors already there are not copied."""
        if isinstance(tree, torch.Tensor):
            return tree.cpu()
        if isinstance(tree, dict):
            return {k: self.to_host(v) for k, v in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self.to_host(v) for v in tree)
        return tree

    def claim(self, cores: list[int], total: int, command: str) -> Lease | None:
        """Own `cores` for this process. The Neuron runtime enforces ownership on real devices."""
        return None

    def process_group_backends(self) -> str:
        """What `init_process_group` is given: the device's backend for its own tensors and, on a
        device that is not the host, gloo for host tensors (the evaluation's logits, object
        gathers, barriers), as `cpu:gloo,neuron:neuron`. One group: each collective goes to the
        backend of its tensors' device."""
        device_type = self.torch_device.type
        if device_type == "cpu":
            return self.process_group_backend
        return f"cpu:gloo,{device_type}:{self.process_group_backend}"

    def side_group(self) -> Any:
        """A process group over every rank of its own, for host tensors (gloo), with the default
        group's timeout: the collectives of work beside the step's (a checkpoint written in the
        background) never interleave with the step's. None with one rank. Every rank makes it, in
        the same order."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            return dist.new_group(backend="gloo", timeout=self._timeout)
        return None

    _timeout: timedelta | None = None
    """The collectives' timeout the process group was made with (`init_process_group`)."""

    def init_process_group(self, world_size: int, timeout_seconds: float) -> None:
        self._timeout = timedelta(seconds=timeout_seconds)
        if world_size > 1 and not dist.is_initialized():
            dist.init_process_group(self.process_group_backends(), init_method=self.init_method,
                                    timeout=timedelta(seconds=timeout_seconds))

    @abstractmethod
    def compiler(self, spec: JobSpec, mode: str = "run", log: Log | None = None,
                 workdir: Path | None = None, model: str = "") -> CompileBackend:
        """The compile backend for the spec's programs, whose cache keys hold `model` (the recipe's
        `name@version`) beside the device's own flags. `run`: graphs come from the spec's persistent
        compile cache, and any other graph is a recompilation; `extract`: graphs are recorded and run
        eagerly (a trial run of ahead-of-time compilation); `compile`: graphs are compiled into
        `workdir`, which `artifact` packs for the cache; `trial` (runtime devices): nothing is
        recorded, for a trial run that the SDK's own parallel compiler wraps."""

    def compile_imports(self, spec: JobSpec) -> list[str]:
        """The modules a compile worker imports to compile the spec's graphs: the compile pool's
        server imports them once, and each worker starts from it with them loaded."""
        return []

    def precompile(self, spec: JobSpec, trial: list[str]) -> ParallelCompile | None:
        """Compile the spec's programs ahead of time with the device's own SDK tools, where they are
        at hand, before trnflow records the graphs; `trial` is the command that runs the trial steps
        alone. What the tool reported, or None where the device has no such tool here."""
        return None

    def artifact(self, workdir: Path) -> bytes:
        """The cache artifact of what `compiler(mode="compile")` built in `workdir`."""
        raise FatalError(f"the {self.name} device compiles ahead of time with its own tools, not trnflow's")

    def reuse_built(self, library: Path, workdir: Path) -> None:
        """Before a compile into `workdir`: bring in what the compile job's earlier programs built and
        `keep_built` kept in `library`, where the compiler finds it instead of building it again. A
        device whose compiler has nothing to share between programs does nothing."""
        return

    def keep_built(self, workdir: Path, library: Path) -> None:
        """After a compile into `workdir` (its artifact packed): keep in `library` what the compile
        job's next programs may reuse."""
        return

    def compile(self, fn: Callable, backend: CompileBackend, whole: bool = True) -> Callable:
        """`fn` as one whole graph with static shapes, compiled through `backend`. `whole=False`: a
        sharded model's, whose FSDP2 hooks split it where each block's weights are gathered (TorchDynamo
        does not trace them): the parts around the blocks are graphs, the blocks run as they are."""
        return torch.compile(fn, backend=backend, fullgraph=whole, dynamic=False)

    def mesh(self, tp: int = 1) -> Any:
        """The job's ranks as a `DeviceMesh` of this device's type, over the job's process group (on a
        device that is not the host, its collectives go to the device's own backend): one dimension,
        what FSDP2 shards over; with tensor parallelism (`tp` > 1) two, `dp` x `tp`, each row of `tp`
        consecutive ranks (the cores of one node) splitting the model and the rows splitting the batch.

        A process on its own (the compile stage's trial) rehearses rank 0: over a group of one, or,
        with `tp` > 1, over a stand-in group of `tp` ranks whose collectives move nothing (PyTorch's
        fake backend), so that it traces the programs of a rank whose layers are split `tp` ways."""
        from torch.distributed.device_mesh import init_device_mesh  # sharded training only

        if not dist.is_initialized() and tp > 1:
            fake_group(tp)
        elif not dist.is_initialized():
            dist.init_process_group(self.process_group_backends(), store=dist.HashStore(), rank=0, world_size=1)
        world = dist.get_world_size()
        if tp == 1:
            return init_device_mesh(self.torch_device.type, (world,))
        return init_device_mesh(self.torch_device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))

    def split(self, plan: TensorPlan, mesh: Any) -> None:
        """Split the layers `plan` names over the mesh's `tp` dimension, in place, with PyTorch's
        tensor parallelism (`parallelize_module`): a column-parallel layer's weight (and bias) becomes a
        DTensor sharded by output, taking the whole input and giving this rank's part of the output; a
        row-parallel layer's weight is sharded by input, taking that part and summing the ranks'
        outputs into the whole (one all-reduce per pair). See `trnflow.device.tensor_parallel`."""
        from trnflow.device.tensor_parallel import split  # tensor-parallel training only: PyTorch's TP styles

        split(plan, mesh["tp"])

    def shard(self, model: torch.nn.Module, blocks: list[torch.nn.Module], mesh: Any = None) -> None:
        """Shard `model` in place over the job's ranks with FSDP2 (`fully_shard`): each of `blocks` as
        a unit of its own, then the rest of the model as the root unit. Its parameters become DTensors
        holding this rank's 1/N. With a two-dimensional `mesh`, over its `dp` dimension (a model
        already split over `tp`: FSDP2 over DTensor, each rank holding 1/dp of its 1/tp). A process
        on its own (the compile stage's trial) shards over a group of one, so that it traces the
        programs the ranks run."""
        from torch.distributed.fsdp import fully_shard  # sharded training only

        mesh = self.mesh() if mesh is None else mesh
        if mesh.ndim == 2:
            mesh = mesh["dp"]
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    def autocast(self, precision: str) -> contextlib.AbstractContextManager:
        """Mixed precision for a forward pass: bf16 autocast unless the spec trains in fp32."""
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.torch_device.type, dtype=torch.bfloat16)

    def rounding(self, precision: str, env: dict[str, str] | None = None) -> str | None:
        """How weights and optimizer state reach the bf16 grid after each update: "stochastic" for
        bf16-sr (or bf16 with NEURON_RT_STOCHASTIC_ROUNDING_EN=1, as the Neuron runtime reads it),
        "nearest" (to even) for bf16-rne, None where fp32 master weights are kept."""
        env = os.environ if env is None else env
        if precision == "bf16-sr" or (precision == "bf16" and env.get("NEURON_RT_STOCHASTIC_ROUNDING_EN") == "1"):
            return STOCHASTIC
        return NEAREST if precision == "bf16-rne" else None

    def round_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, mode: str,
                    generator: torch.Generator) -> None:
        """Put the weights and the optimizer's per-weight state on the bf16 grid after an update,
        rounding as `mode` says. The hardware rounds as it writes, so a real device has nothing to do here."""
        return None

    def sync(self) -> None:
        """Where a lazy device runs what it has traced (after backward, after the optimizer step)."""
        return None

    def fault_hooks(self, core: int, spec: JobSpec | None) -> FaultHooks:
        """The faults injected into `core`; none on a device without a fault model."""
        return NoFaults()

    def check_launch_env(self, env: dict[str, str]) -> None:
        """Refuse, before anything starts, an environment the device's workers could not run with."""
        return None

    def allocate(self, count: int, total: int, exclude: frozenset[int] = frozenset()) -> list[int]:
        """`count` free contiguous cores, aligned to `count`, avoiding `exclude`."""
        return aligned_ranges(count, total, exclude)[0]

    def busy(self, cores: list[int], total: int) -> str | None:
        """Which of `cores` another process holds, and who (`nc0 held by pid 12 (...)`), or None when
        all are free. None where the device cannot tell (the runtime refuses a held core at claim)."""
        return None
