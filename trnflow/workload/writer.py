"""A whole checkpoint written by a process of its own (`CheckpointWriter`, which starts it).

A thread of the training process would do the same work, but it shares the interpreter's lock
with the training loop, which dispatches its operations from Python (the emulator, torch-xla's
tracing and TorchNeuron's eager mode alike): serializing and hashing a large state beside the
steps slowed them by as much as the write took. Here the loop only copies the state into memory
both processes map (`Staging`, laid out once and reused), and the writer process serializes it,
writes every file through the store and commits the marker last (`RunCheckpoints.save`), then
answers with the checkpoint's URL (`Reply`, as JSON). The loop's `BackgroundSaver` thread waits for that answer,
which holds no lock.

The writer runs on the CPUs the rank was not pinned to, if any. It dies with the rank (Linux:
the parent-death signal), so a rank killed mid-write leaves a folder without its marker, as it
would have with the thread. A request crosses the pipe pickled (the state's layout, its random
streams and its meta), from the rank to the child it started, and nothing else writes to it.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import pickle
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from trnflow.records import CheckpointMeta
from trnflow.workload.checkpoint import RunCheckpoints
from trnflow.workload.tuning import unpinned

ALIGN = 64
"""Each staged tensor starts at a multiple of this many bytes."""
HURRY = 0
"""The byte of the shared memory (before the first tensor) the loop sets when it waits for the
write in flight: the writer then writes what is left at once, no longer paced (`Pace`)."""


NICENESS = 10
"""How much lower than the rank's the writer process's scheduling priority is: a paced write has
time, so on a host whose spare CPUs are few, the host's other work (the launcher, the orchestrator)
takes the writer's CPU rather than moving onto a rank's."""
PROCESS_BYTES = 64 << 20
"""`train.checkpoint_writer: auto` writes in the process a state of at least this many bytes: less
is serialized in a fraction of a second, and starting the process costs about a second of a CPU."""


def in_process(setting: str, model: dict, optim: dict) -> bool:
    """Whether a background checkpoint of this state is written by the writer process."""
    return setting == "process" or (setting == "auto" and _tree_bytes([model, optim]) >= PROCESS_BYTES)


def _tree_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tree_bytes(v) for v in tree.values())
    if isinstance(tree, list | tuple):
        return sum(_tree_bytes(v) for v in tree)
    return 0


@dataclass(frozen=True)
class Slot:
    """Where one staged tensor lies in the shared memory."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _layout(tree: Any, offset: int = 0) -> tuple[Any, int]:
    """`tree` with each tensor replaced by the `Slot` it takes from `offset` on; the end offset."""
    if isinstance(tree, torch.Tensor):
        slot = Slot(offset, tree.dtype, tuple(tree.shape))
        return slot, offset + -(-max(slot.nbytes, 1) // ALIGN) * ALIGN
    if isinstance(tree, dict):
        laid = {}
        for key, value in tree.items():
            laid[key], offset = _layout(value, offset)
        return laid, offset
    if isinstance(tree, list | tuple):
        items = []
        for value in tree:
            item, offset = _layout(value, offset)
            items.append(item)
        return type(tree)(items), offset
    return tree, offset


def _slots(tree: Any) -> Any:
    """A layout's shape alone: its slots where they lie, every other value (a learning rate a
    schedule moves) left out. Two layouts of the same shape fit the same memory."""
    if isinstance(tree, dict):
        return {key: _slots(value) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return [_slots(value) for value in tree]
    return tree if isinstance(tree, Slot) else None


def _views(tree: Any, memory: memoryview) -> Any:
    """`tree` with each `Slot` replaced by a tensor over its bytes of `memory`: a storage of its
    own for each, so that `torch.save` writes each tensor's bytes and no one else's."""
    if isinstance(tree, Slot):
        if tree.nbytes == 0:
            return torch.empty(tree.shape, dtype=tree.dtype)
        return torch.frombuffer(memory[tree.offset:tree.offset + tree.nbytes], dtype=tree.dtype).view(tree.shape)
    if isinstance(tree, dict):
        return {key: _views(value, memory) for key, value in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_views(value, memory) for value in tree)
    return tree


def _copy(into: Any, tree: Any) -> None:
    if isinstance(tree, torch.Tensor):
        into.copy_(tree.detach())
    elif isinstance(tree, dict):
        for key, value in tree.items():
            _copy(into[key], value)
    elif isinstance(tree, list | tuple):
        for mine, value in zip(into, tree, strict=True):
            _copy(mine, value)


def _memory(size: int) -> int:
    """A file descriptor of `size` bytes of memory no path names: nothing is left behind however
    the processes end."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("trnflow-checkpoint-staging", 0)
    else:  # macOS: a file unlinked at once
        fd, path = tempfile.mkstemp(prefix="trnflow-staging-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


@dataclass(frozen=True)
class Request:
    """One checkpoint for the writer to save, as `RunCheckpoints.save` takes it; `model` and
    `optim` laid out in the shared memory (`Slot`s); `seconds`: spread the write over about that
    long (`Pace`), unless hurried, or as fast as it goes (None). Without `meta`, only its files are
    written (`RunCheckpoints.write_files`), for the parent to commit once it knows the meta."""

    run_url: str
    step: int
    model: Any
    optim: Any
    rng: list[dict]
    featurizer: tuple[str, bytes]
    meta: CheckpointMeta | None
    keep_latest: int | None
    seconds: float | None = None


class Pace:
    """Spreads about `size` bytes of writes evenly over `seconds`, waiting after each part written
    while it is ahead, until `hurried()`.

    A checkpoint written at the disk's full speed beside training slows the steps beside it (on a
    VM here, by about 15% while it writes into the page cache at 800 MB/s; by nothing measurable
    at 140 MB/s), more than the same bytes written at a pace: there is time for it, the next
    checkpoint being steps away."""

    def __init__(self, size: int, seconds: float, hurried: Callable[[], bool]):
        self.rate, self.hurried = max(size, 1) / seconds, hurried
        self.began, self.done = time.monotonic(), 0

    def __call__(self, written: int) -> None:
        self.done += written
        while not self.hurried():
            ahead = self.done / self.rate - (time.monotonic() - self.began)
            if ahead <= 0:
                return
            time.sleep(min(ahead, 0.05))


class Reply(BaseModel):
    """The writer's answer to one `Request`: the checkpoint's URL (or, asked for its files only,
    their checksums), or what went wrong."""

    model_config = ConfigDict(extra="forbid")
    url: str = ""
    files: dict[str, dict] = {}
    error: str = ""
    retryable: bool | None = None


class WriteFailed(Exception):
    """A checkpoint the writer process could not save, with what it said; `retryable` as the
    error it met was (a writer process that ended is: the retry resumes from the checkpoint before)."""

    def __init__(self, message: str, retryable: bool | None):
        super().__init__(message)
        self.retryable = retryable


def _send(fd: int, data: bytes) -> None:
    view = memoryview(struct.pack("<Q", len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _receive(fd: int) -> bytes | None:
    """The next message on `fd`, or None once the other end has closed it."""
    head = _read(fd, 8)
    return None if head is None else _read(fd, struct.unpack("<Q", head)[0])


def _read(fd: int, size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@dataclass
class Staging:
    """The layout of the state last staged, and the tensors over the shared memory it lies in."""

    layout: Any
    tensors: Any = field(repr=False)


class CheckpointWriter:
    """A writer process and the memory it shares with the training loop. `stage` at the step
    boundary (in the loop), `save` from the background thread; one checkpoint at a time."""

    def __init__(self) -> None:
        self._process: subprocess.Popen | None = None
        self._requests = self._replies = -1
        self._map: mmap.mmap | None = None
        self._staging: Staging | None = None

    def prepare(self, model: dict, optim: dict) -> Any:
        """Lay out memory for `model` and `optim` (state dicts) and start the writer process, copying
        nothing, unless a state laid out alike is prepared already; the layout. Called once an
        attempt's first step has made the optimizer's state, it takes the process's start and the
        memory's first touch (the writer's to make) off the first checkpoint's stop."""
        layout, size = _layout({"model": model, "optim": optim}, ALIGN)  # the first ALIGN bytes: HURRY
        if self._staging is None or _slots(self._staging.layout) != _slots(layout):
            self._start(layout, size)
        return layout

    def stage(self, model: dict, optim: dict) -> tuple[Any, Any]:
        """Copy `model` and `optim` (state dicts) into the shared memory, which the training that
        goes on cannot change; their layouts, for `save`. A state laid out otherwise than the one
        prepared (or none prepared) starts the writer process with memory of the new size first."""
        layout = self.prepare(model, optim)
        assert self._staging is not None and self._map is not None
        _copy(self._staging.tensors, {"model": model, "optim": optim})
        self._map[HURRY] = 0
        return layout["model"], layout["optim"]

    def hurry(self) -> None:
        """Have the write in flight, if any, go on at full speed (the loop is about to wait for it).
        The saver's thread may close the memory meanwhile (its writer ended): then there is none."""
        memory = self._map
        if memory is not None:
            with contextlib.suppress(ValueError):  # closed
                memory[HURRY] = 1

    def save(self, request: Request) -> str:
        """Have the writer save the checkpoint `request` describes (staged by `stage` before);
        its URL once committed, or WriteFailed."""
        assert request.meta is not None, "a checkpoint committed by the writer has its meta"
        return self._ask(request).url

    def write_files(self, request: Request) -> dict[str, dict]:
        """Have the writer write the files of the checkpoint `request` describes (its `meta` None),
        not committing it; their checksums (`RunCheckpoints.commit` takes them), or WriteFailed."""
        assert request.meta is None, "the writer writes the files of a checkpoint whose meta comes later"
        return self._ask(request).files

    def _ask(self, request: Request) -> Reply:
        assert self._process is not None, "stage() the checkpoint before saving it"
        try:
            _send(self._requests, pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
            answer = _receive(self._replies)
        except OSError:
            answer = None
        if answer is None:
            code = self._process.wait()
            self.close()  # the next checkpoint starts another
            raise WriteFailed(f"the checkpoint writer process ended (exit code {code}) before step {request.step}'s "
                              "checkpoint was committed", retryable=True)
        reply = Reply.model_validate_json(answer)
        if reply.error:
            raise WriteFailed(f"writing the checkpoint of step {request.step}: {reply.error}", reply.retryable)
        return reply

    def _start(self, layout: Any, size: int) -> None:
        self.close()
        fd = _memory(max(size, ALIGN))
        try:
            self._map = mmap.mmap(fd, max(size, ALIGN))
            requests, self._requests = os.pipe()
            self._replies, replies = os.pipe()
            spare = _spare_cpus()
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOOT, str(os.getpid()), str(fd), str(max(size, ALIGN)),
                 str(requests), str(replies), ",".join(map(str, spare)), str(NICENESS)],
                pass_fds=(fd, requests, replies), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            os.close(requests)
            os.close(replies)
        finally:
            os.close(fd)
        self._staging = Staging(layout, _views(layout, memoryview(self._map)))

    def close(self) -> None:
        """End the writer process (once its write in flight, if any, was waited for)."""
        self._staging = None
        for fd in (self._requests, self._replies):
            if fd >= 0:
                os.close(fd)
        self._requests = self._replies = -1
        if self._process is not None:
            try:
                self._process.wait(timeout=30)  # it ends at the end of its requests
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: the map goes with it
                self._map.close()
            self._map = None


_BOOT = """import os, sys
cpus, niceness = sys.argv[6], int(sys.argv[7])
if cpus and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
os.nice(niceness)
from trnflow.workload.writer import main
sys.exit(main(sys.argv[1:]))
"""
"""The writer process's first lines: off the rank's CPUs before it imports anything (it inherits
the rank's pinning, and its imports take seconds of a CPU) and at a lower priority (`NICENESS`),
then `main`."""


def _spare_cpus() -> list[int]:
    """The CPUs this process may run on but was not pinned to (`tuning.pin_cpus`); none when it
    was not pinned."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    mine = os.sched_getaffinity(0)
    return sorted(set(unpinned()) - mine)


def _die_with_parent() -> None:
    """Be killed when the process that started this one ends (Linux); elsewhere the closed pipe
    ends it once its write in flight is done."""
    with_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None
    if with_prctl is not None:
        with_prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _save(request: Request, memory: memoryview) -> Reply:
    pace = None
    if request.seconds:  # the memory holds the state laid out: about the bytes the write will pass on
        pace = Pace(len(memory), request.seconds, lambda: memory[HURRY] != 0)
    checkpoints = RunCheckpoints(request.run_url)
    files = checkpoints.write_files(request.step, _views(request.model, memory), _views(request.optim, memory),
                                    request.rng, request.featurizer, pace=pace)
    if request.meta is None:
        return Reply(files=files)
    return Reply(url=checkpoints.commit(request.step, files, request.meta, keep_latest=request.keep_latest))



def main(argv: list[str]) -> int:
    parent, fd, size, requests, replies = (int(arg) for arg in argv[:5])
    _die_with_parent()
    if os.getppid() != parent:  # it ended before the signal was asked for
        return 1
    torch.set_num_threads(1)
    if hasattr(os, "posix_fallocate"):  # the memory's pages made here, not in the training loop's first copy
        with contextlib.suppress(OSError):
            os.posix_fallocate(fd, 0, size)
    memory = memoryview(mmap.mmap(fd, size))
    while (message := _receive(requests)) is not None:
        try:
            reply = _save(pickle.loads(message), memory)  # noqa: S301 (its parent's own pipe)
        except Exception as exc:
            reply = Reply(error=f"{type(exc).__name__}: {exc}", retryable=getattr(exc, "retryable", None))
        _send(replies, reply.model_dump_json().encode())
    return 0

