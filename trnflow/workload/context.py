"""The worker's view of the job: who it is among the ranks, which core it owns, where results go.

The launcher passes the contract the way torchrun and the Neuron runtime do: RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/PORT from torchrun, NEURON_RT_VISIBLE_CORES for the cores this process
group may use. Each rank owns one core of that set.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from trnflow.device.base import Device, FaultHooks, Lease, NoFaults
from trnflow.device.registry import choose, get_device
from trnflow.errors import CollectiveTimeout, FatalError
from trnflow.fsutil import atomic_write_json
from trnflow.neuron.launch import INSTANCE_CORES_ENV, PIN_CPUS_ENV, rank_threads
from trnflow.results import FailureReport, StageResult
from trnflow.specs import JobSpec
from trnflow.workload import watchdog
from trnflow.workload.tuning import pin_cpus, steady_heap

T = TypeVar("T")


@dataclass
class WorkerContext:
    spec: JobSpec | None
    output_dir: Path
    rank: int
    world_size: int
    local_rank: int
    core_id: int
    options: dict[str, Any] = field(default_factory=dict)
    faults: FaultHooks = field(default_factory=NoFaults)
    lease: Lease | None = None
    device: Device = field(default_factory=get_device)
    device_reason: str = ""
    """Why this device runs the job (`trnflow.device.registry.choose`)."""
    _progress: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        """The cores that split the model between them (`train.parallelism.tp`): 1 without tensor parallelism."""
        return 1 if self.spec is None else self.spec.tp  # decided: the program refuses a spec that is not

    @property
    def replica(self) -> int:
        """Which replica of the model this rank computes: the ranks of one tensor-parallel group (`tp`
        consecutive ranks) compute the same samples together, and the batch is split over the replicas."""
        return self.rank // self.tp

    @property
    def replicas(self) -> int:
        return self.world_size // self.tp

    def log(self, event: str, all_ranks: bool = False, **fields: Any) -> None:
        """One JSON line on stdout, from rank 0 unless `all_ranks`: machine-readable progress that
        every backend's log stream carries."""
        if all_ranks or self.is_main:
            record = {"ts": round(time.time(), 3), "event": event, "rank": self.rank, **fields}
            print(json.dumps(record), flush=True)
        watchdog.beat(f"{event} at step {fields['step']}" if "step" in fields else event)

    def progress(self, label: str) -> None:
        """Record how far this rank got, so a rank that hangs can be named by its peers."""
        self._progress += 1
        watchdog.beat(label)
        atomic_write_json(self.output_dir / f"progress-rank{self.rank}.json",
                          {"rank": self.rank, "core": self.core_id, "seq": self._progress, "label": label})

    def laggards(self) -> list[dict]:
        """The ranks that got least far (by their progress records)."""
        records = []
        for r in range(self.world_size):
            path = self.output_dir / f"progress-rank{r}.json"
            missing = {"rank": r, "core": None, "seq": 0, "label": None}
            records.append(json.loads(path.read_text()) if path.exists() else missing)
        least = min(rec["seq"] for rec in records)
        return [rec for rec in records if rec["seq"] == least and least < max(x["seq"] for x in records)]

    def collective(self, label: str, fn: Callable[[], T]) -> T:
        """Run one collective step; a rank that never arrives is cut off by the process group's
        timeout and named, from the progress records, in a CollectiveTimeout."""
        if self.world_size == 1 and "hang" in self.faults.kinds:  # no peer to time it out: say so at once
            raise CollectiveTimeout(f"{label}: core {self.core_id} stalled", bad_cores=[self.core_id])
        self.faults.maybe_hang()  # a stalled core never posts its part of the op
        self.progress(label)
        try:
            return fn()
        except (RuntimeError, dist.DistBackendError) as exc:
            stuck = self.laggards()
            if not stuck:  # every rank got here: not a hang, a plain error
                raise
            who = ", ".join(f"core {s.get('core', '?')} (rank {s['rank']})" for s in stuck)
            raise CollectiveTimeout(
                f"{label} did not complete: {who} never reached it "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}). Exclude or replace that core",
                bad_cores=[s["core"] for s in stuck if s.get("core") is not None],
            ) from None

    def write_result(self, result: StageResult) -> None:
        """Rank 0's `result.json`, which the orchestrator reads back as the same model."""
        if self.is_main:
            atomic_write_json(self.output_dir / "result.json", result.model_dump(mode="json"))


def exit_with_launcher(poll_seconds: float = 0.5) -> None:
    """End this worker when the process that launched it dies. torchrun starts each worker in a
    session of its own, so a launcher killed with SIGKILL (or a job's process group killed) would
    otherwise leave the workers training on, holding their cores and writing the run's checkpoints
    while its retry does the same."""
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-launcher", daemon=True).start()


def init_worker(spec: JobSpec | None, output_dir: Path, phase: str, options: dict[str, Any] | None = None,
                run_id: str | None = None) -> WorkerContext:
    """Own this rank's NeuronCore (held for run `run_id`, as others are told), then join the process
    group (the device's backend)."""
    exit_with_launcher()
    choice = choose(spec)
    device = get_device(choice.name)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    visible = device.visible_cores()
    if local_rank >= len(visible):
        raise FatalError(f"NEURON_RT_VISIBLE_CORES gives {len(visible)} core(s) but this is local rank {local_rank}; "
                         "give one core per worker process")
    core_id = visible[local_rank]
    total = int(os.environ.get(INSTANCE_CORES_ENV, str(max(visible) + 1)))
    lease = device.claim([core_id], total, command=f"trnflow.workload {phase} rank {rank}" + (
        f" of run {run_id}" if run_id and run_id != "adhoc" else ""))  # named to a job that waits for this core
    timeout = spec.preflight.collective_timeout_seconds if spec else float(
        (options or {}).get("timeout_seconds", 60.0))
    # The group first: its transport's threads (gloo's) are made now and keep the CPUs they are made
    # with, so pinning after leaves them free to run beside the rank's own thread. Pinned first, they
    # shared its one CPU, and a sharded step (a gather or reduce-scatter a block) took 3 ms more.
    device.init_process_group(world, timeout)
    # The host's CPUs shared between the ranks keeps them from fighting over CPUs (oversubscription is slow).
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or rank_threads(world)
    if os.environ.get(PIN_CPUS_ENV) == "1":
        pin_cpus(local_rank, threads, len(visible), visible[0])
    torch.set_num_threads(threads)
    steady_heap()
    output_dir.mkdir(parents=True, exist_ok=True)
    ctx = WorkerContext(spec, output_dir, rank, world, local_rank, core_id, dict(options or {}),
                        device.fault_hooks(core_id, spec), lease, device, choice.reason)
    if spec is not None:
        watch_progress(ctx, spec.compute.hang_timeout_minutes * 60)
    ctx.progress("started")
    return ctx


def watch_progress(ctx: WorkerContext, limit_seconds: float) -> None:
    """End this rank as `Stalled` once it makes no progress for `limit_seconds` (see `watchdog`)."""
    host = watchdog.host_label()

    def stalled(seconds: float, label: str, pace: watchdog.Pace | None) -> None:
        step, behind = pace.behind() if pace is not None else (None, [])
        message = watchdog.stalled_message(ctx.rank, ctx.core_id, host, seconds, label,
                                           pace.why if pace is not None else watchdog.BASE_LIMIT, behind, step)
        atomic_write_json(ctx.output_dir / f"failure-rank{ctx.rank}.json", FailureReport(
            rank=ctx.rank, type="Stalled", message=message, retryable=True,
            ranks=[p.rank for p in behind]).model_dump(exclude_none=True))
        print(f"trnflow.workload: {message}", file=sys.stderr, flush=True)

    watchdog.start(limit_seconds, stalled)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: WorkerContext, group: Any = None) -> None:
    """Wait until every rank gets here (over `group`, the default process group when None)."""
    if ctx.world_size > 1:
        dist.barrier(group=group)


def gather_objects(ctx: WorkerContext, obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank; over `group`, the default process group
    when None)."""
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj, group=group)
    return out
