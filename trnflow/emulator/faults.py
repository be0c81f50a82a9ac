"""Fault injection: reproducible failures of chosen emulated cores.

Faults come from the spec's `faults` list and from `TRNFLOW_FAULTS`, a comma-separated list of
`kind@core` or, for faults that strike at a step, `kind@core:step` or `kind@core:phase:step` (for
example `corrupt@1,hang@3,kill@0:30,torn@0:infer:2`). The launcher hands the merged list to every worker; a worker
applies the faults of the core it owns.

Device faults (corrupt, hang, memory, slow) are properties of a core and strike every time. Step faults
strike once per run, at a training step or, in inference, at the rank's n-th shard (`phase` picks
one; without it, once in each):
- `kill`: the rank's process is killed with SIGKILL (as the OOM killer or a lost host would);
- `timeout`: the runtime reports an execution timeout (transient: retry and resume);
- `hw`: the core reports an uncorrectable hardware error (retry on other cores);
- `nan`: the core's result turns to NaN, so the loss is not finite (fatal: never retried);
- `spike`: the step's loss comes back a thousandfold and more, as a loss spike (a divergence that
  `train.on_divergence: rollback` heals);
- `stall`: the rank stops making progress, as on a device that never returns; its own watchdog (or
  the peers') ends it;
- `freeze`: the rank's process stops whole (SIGSTOP), its watchdog included, as on a host that
  stopped answering: only its peers' watchdogs (or the collective timeout) can notice;
- `torn`: the rank is killed halfway through writing its next checkpoint or shard, which is left
  cut short under its own name (as a copy that died, or a storage fault, leaves it). Only rank 0
  writes a whole checkpoint: another rank is killed once the checkpoint is whole, or, when it is
  written in the background, while rank 0 writes it.

A step fault strikes once its rank's checkpoint write in flight has committed (the training loop's
`settle`); rank 0, whose write a fault on another rank interrupts, lets it commit before it ends.
So a case redoes the same steps however checkpoints are written. A `torn` write in the background
is one the loop waits for, so its rank dies at that step.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from trnflow.errors import ExecutionTimeout, FatalError, HardwareError

FAULTS_ENV = "TRNFLOW_FAULTS"


def _nothing() -> None:
    return None


DEVICE_KINDS = ("corrupt", "hang", "memory", "slow")
TRAINING_KINDS = ("kill", "timeout", "hw", "nan", "spike", "stall", "freeze", "torn")
PHASES = ("train", "infer")
KINDS = DEVICE_KINDS + TRAINING_KINDS


@dataclass(frozen=True)
class Fault:
    kind: str
    core: int
    step: int | None = None
    phase: str | None = None

    @property
    def label(self) -> str:
        where = "".join(f":{part}" for part in (self.phase, self.step) if part is not None)
        return f"{self.kind}@{self.core}{where}"


def parse(text: str) -> list[Fault]:
    """`corrupt@1,hang@3` (or the JSON list the launcher writes) -> faults."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        return [Fault(f["kind"], int(f["core"]), f.get("step"), f.get("phase")) for f in json.loads(text)]
    faults = []
    for item in text.split(","):
        kind, sep, where = item.strip().partition("@")
        core, *at = where.split(":")
        phase, step = (at[0] if len(at) == 2 else None), (at[-1] if at else None)
        training = kind in TRAINING_KINDS
        if not sep or kind not in KINDS or not core.isdigit() or training != bool(at) or len(at) > 2 or (
                at and not step.isdigit()) or (phase is not None and phase not in PHASES):
            raise FatalError(
                f"{FAULTS_ENV}: {item!r} is not kind@core ({', '.join(DEVICE_KINDS)}) or kind@core:step or "
                f"kind@core:phase:step ({', '.join(TRAINING_KINDS)}; phase {' or '.join(PHASES)})"
            )
        faults.append(Fault(kind, int(core), int(step) if step else None, phase))
    return faults


def encode(faults: list[Fault]) -> str:
    return json.dumps([{"kind": f.kind, "core": f.core, "step": f.step, "phase": f.phase} for f in faults])


class CoreFaults:
    """The faults that hit one core, as the workload sees them."""

    def __init__(self, core: int, faults: list[Fault] | None = None):
        if faults is None:
            faults = parse(os.environ.get(FAULTS_ENV, ""))
        self.core = core
        self.kinds = {f.kind for f in faults if f.core == core and f.step is None}
        self.training = [f for f in faults if f.core == core and f.step is not None]
        self._poison = self._spike = self._torn = False

    # The training loop's hooks: a step begins, its result comes back, a checkpoint is written.
    def begin_step(self, step: int, first_time: Callable[[Fault], bool], settle: Callable[[], None] = _nothing
                   ) -> None:
        """Fire the faults due at training step `step`, each once `settle()` returned; a `nan` or
        `spike` changes this step's result, a `torn` the next checkpoint."""
        due = self.strike(step, first_time, "train", settle)
        self._poison, self._spike, self._torn = "nan" in due, "spike" in due, self._torn or "torn" in due

    def result(self, t: torch.Tensor) -> torch.Tensor:
        if self._poison:
            return t * float("nan")
        return t * 1000 + 100 if self._spike else t

    def slow_down(self, seconds: float) -> None:
        """A `slow` core does a training step's own work at a third of the speed (a throttled or ailing
        host): far enough past `compute.slow_rank_factor`'s usual 1.5 that a busy machine's noise in
        the peers' times does not hide it."""
        if "slow" in self.kinds:
            time.sleep(2 * seconds)

    def checkpoint_store(self, checkpoints: Any, writer: bool) -> Any:
        """The checkpoints to write through: torn halfway (and the writer killed) after a `torn` fault."""
        if self._torn and writer:
            return type(checkpoints)(checkpoints.url, TearingStore(checkpoints.store))
        return checkpoints

    def checkpoint_written(self) -> None:
        """A torn fault on a rank that writes nothing: it is lost once the checkpoint is whole."""
        if self._torn:
            os.kill(os.getpid(), signal.SIGKILL)

    def tearing(self, store: Any) -> Any:
        return TearingStore(store)

    def marker(self) -> bytes:
        """What a fired fault's marker holds: who fired it, unique to this process."""
        return f"core {self.core} pid {os.getpid()} at {time.time():.6f}".encode()

    def strike(self, step: int, first_time: Callable[[Fault], bool], phase: str = "train",
               settle: Callable[[], None] = _nothing) -> set[str]:
        """Fire this core's step faults due at `step` of `phase` (steps count from 1), each once per
        run: `first_time(fault)` records the fault and says whether it had fired before; `settle()`
        runs first. Returns the kinds the caller must act on: `nan` (poison the step's result),
        `torn` (write the next checkpoint or shard through `tearing`)."""
        act: set[str] = set()
        for fault in self.training:
            if fault.step != step or fault.phase not in (None, phase) or not first_time(fault):
                continue
            settle()
            if fault.kind in ("nan", "spike", "torn"):
                act.add(fault.kind)
                continue
            if fault.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "stall":
                while True:
                    time.sleep(3600)
            if fault.kind == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # until the launcher's SIGKILL
            if fault.kind == "timeout":
                raise ExecutionTimeout(f"NeuronCore {self.core}: execution timed out at step {step} "
                                       "(injected fault); the run resumes from its last checkpoint")
            raise HardwareError(f"NeuronCore {self.core}: uncorrectable hardware error at step {step} "
                                "(injected fault); retry on other cores", bad_cores=[self.core])
        return act

    def corrupt(self, t: torch.Tensor) -> torch.Tensor:
        """A wrong answer from this core's engines: a few elements off by a visible margin."""
        if "corrupt" not in self.kinds or t.numel() == 0:
            return t
        out = t.clone()
        flat = out.view(-1)
        flat[:: max(1, flat.numel() // 7)] += 0.5 + flat[:: max(1, flat.numel() // 7)].abs()
        return out

    def flip_bits(self, buf: torch.Tensor) -> None:
        """Stuck bits in this core's memory: one word in every 4096 loses its lowest bit."""
        if "memory" in self.kinds:
            buf.view(-1)[::4096].bitwise_xor_(1)

    def maybe_hang(self) -> None:
        """Stall forever, as a core hung in a collective does; the peers' timeout cuts it off."""
        if "hang" in self.kinds:
            while True:
                time.sleep(3600)


class TearingStore:
    """A store whose first write is cut short, after which the process is killed: a `torn` fault."""

    def __init__(self, store: Any):
        self._store = store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def write(self, name: str, data: bytes) -> None:
        self._store.write(name, data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[BinaryIO]:
        buffer = io.BytesIO()
        yield buffer
        self.write(name, buffer.getvalue())
