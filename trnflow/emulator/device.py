"""The emulator as a `Device`: NeuronCores emulated by CPU processes.

Tensors live on the CPU, ranks join over gloo, programs compile through the emulator's compiler
(TorchInductor, or AOT autograd at -O1) into the persistent compile cache, bf16 rounding (stochastic or
to nearest) is done in software after each update, and each core is owned through a lock file as the Neuron
runtime enforces it. The emulator's fault model (`trnflow.emulator.faults`) is its fault hooks.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trnflow.device import plans
from trnflow.device.base import Device, FaultHooks, Lease, Log, RecompileGuard
from trnflow.device.tracing import TRACING_MODULES
from trnflow.emulator import cores
from trnflow.emulator.compiler import (
    LOWERING_IMPORTS,
    OPTLEVELS,
    compile_flags,
    drop_unused_kernels,
    keep_kernels,
    reuse_kernels,
)
from trnflow.emulator.faults import FAULTS_ENV, CoreFaults, Fault, parse
from trnflow.emulator.jit import CachedCompiler
from trnflow.emulator.numerics import round_bf16_
from trnflow.processes import pid_alive
from trnflow.safetar import pack
from trnflow.specs import JobSpec


class EmulatorDevice(Device):
    name = "emulator"
    process_group_backend = "gloo"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    def claim(self, cores_: list[int], total: int, command: str) -> Lease:
        return cores.acquire(cores_, total, command=command)

    def allocate(self, count: int, total: int, exclude: frozenset[int] = frozenset()) -> list[int]:
        return cores.allocate(count, total, exclude)

    def busy(self, cores_: list[int], total: int) -> str | None:
        held = {core: h for core, h in cores.holders(total).items() if core in cores_}
        return cores.held_text(held) or None

    def compiler(self, spec: JobSpec, mode: str = "run", log: Log | None = None,
                 workdir: Path | None = None, model: str = "") -> CachedCompiler:
        """`run`: graphs load from the spec's persistent cache into a private Inductor folder (so a
        machine-wide Inductor cache cannot make a cold compile look warm); `extract`: graphs are only
        recorded; `compile`: graphs are lowered into `workdir`, which `artifact` then packs."""
        flags = {**compile_flags(spec.compile.optlevel, spec.compute.precision), "model": model}
        if mode == "extract":
            return CachedCompiler(flags, mode="extract")
        if mode == "compile":
            return CachedCompiler(flags, mode="compile", inductor_dir=workdir)
        inductor_dir = private_inductor_dir()
        return CachedCompiler(flags, plans.job_cache(spec), mode="run",
                              guard=RecompileGuard(spec.compile.recompile_limit), inductor_dir=inductor_dir,
                              log=log or (lambda event, **fields: None))

    def artifact(self, workdir: Path) -> bytes:
        drop_unused_kernels(workdir)
        return pack(workdir)

    def reuse_built(self, library: Path, workdir: Path) -> None:
        reuse_kernels(library, workdir)

    def keep_built(self, workdir: Path, library: Path) -> None:
        keep_kernels(workdir, library)

    def compile_imports(self, spec: JobSpec) -> list[str]:
        """TorchDynamo, which traces each program, and the lowering the optlevel uses."""
        return [*TRACING_MODULES, *LOWERING_IMPORTS[OPTLEVELS[spec.compile.optlevel]["backend"]]]

    def round_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, mode: str,
                    generator: torch.Generator) -> None:
        """Weights, then each weight's optimizer state (Adam's moments; never a 0-d step count),
        rounded in place in a fixed order, so every replica draws the same rounding stream."""
        with torch.no_grad():
            for p in model.parameters():
                round_bf16_(_local(p.data), mode, generator)
                state = optimizer.state.get(p, {}) if optimizer is not None else {}
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() and value.dtype == torch.float32:
                        round_bf16_(_local(value), mode, generator)

    def fault_hooks(self, core: int, spec: JobSpec | None) -> FaultHooks:
        """The spec's faults and TRNFLOW_FAULTS's, whichever backend started the worker, for `core`."""
        injected = parse(os.environ.get(FAULTS_ENV, ""))
        if spec is not None:
            injected += [Fault(f.kind, f.core, f.step, f.phase) for f in spec.faults]
        return CoreFaults(core, list(dict.fromkeys(injected)))

    def check_launch_env(self, env: dict[str, str]) -> None:
        parse(env.get(FAULTS_ENV, ""))  # a malformed fault list fails before launch


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: its shard of a sharded (DTensor) weight, rounded in place."""
    return t.to_local() if isinstance(t, DTensor) else t


INDUCTOR_PREFIX = "trnflow-inductor-"


def private_inductor_dir(root: Path | None = None) -> Path:
    """A folder of this process's own for Inductor's files (under the system's temporary folder),
    removed when the process exits. Folders of processes that ended without their exit handlers (a
    rank killed by a signal) are removed first: each is named after its process."""
    root = Path(root or tempfile.gettempdir())
    for folder in root.glob(f"{INDUCTOR_PREFIX}*-*"):
        pid = folder.name[len(INDUCTOR_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
    path = Path(tempfile.mkdtemp(prefix=f"{INDUCTOR_PREFIX}{os.getpid()}-", dir=root))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path
