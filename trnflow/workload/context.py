"""The worker's view of the job: who it is among the ranks, which core it owns, where results go.

The launcher passes the contract the way torchrun and the Neuron runtime do: RANK, WORLD_SIZE,
LOCAL_RANK and MASTER_ADDR/PORT from torchrun, NEURON_RT_VISIBLE_CORES for the cores this process
group may use. Each rank owns one core of that set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from jobspecs import JobSpec
from trnflow.fsutil import atomic_write_json


def parse_core_range(value: str) -> list[int]:
    """`NEURON_RT_VISIBLE_CORES` is a single index ("3") or an inclusive range ("0-7")."""
    value = value.strip()
    first, sep, last = value.partition("-")
    lo, hi = int(first), int(last) if sep else int(first)
    if hi < lo:
        raise ValueError(f"NEURON_RT_VISIBLE_CORES={value!r}: range end is below its start")
    return list(range(lo, hi + 1))


@dataclass
class WorkerContext:
    spec: JobSpec
    output_dir: Path
    rank: int
    world_size: int
    local_rank: int
    core_id: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def log(self, event: str, **fields: Any) -> None:
        """One JSON line on stdout: machine-readable progress that every backend's log stream carries."""
        record = {"ts": round(time.time(), 3), "event": event, "rank": self.rank, **fields}
        print(json.dumps(record), flush=True)

    def write_result(self, result: dict[str, Any]) -> None:
        if self.is_main:
            atomic_write_json(self.output_dir / "result.json", result)


def init_worker(spec: JobSpec, output_dir: Path) -> WorkerContext:
    """Join the process group (gloo) and pin this rank to its emulated NeuronCore."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cores = parse_core_range(os.environ.get("NEURON_RT_VISIBLE_CORES", str(local_rank)))
    core_id = cores[local_rank % len(cores)]
    # One host thread per emulated core keeps ranks from fighting over CPUs (oversubscription is slow).
    threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // max(1, world))
    torch.set_num_threads(threads)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    output_dir.mkdir(parents=True, exist_ok=True)
    return WorkerContext(spec, output_dir, rank, world, local_rank, core_id)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def gather_objects(ctx: WorkerContext, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    if ctx.world_size == 1:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def eprint(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)
