"""How a worker process is set up on its host, torch-free: CPUs of its own, when the spec asks for
them (`PIN_CPUS_ENV`), and a heap that keeps each batch's memory rather than faulting it in again.
Every rank calls both as it starts (`trnflow.workload.context.init_worker`).
"""

from __future__ import annotations

import ctypes
import os


def pin_cpus(local_rank: int, threads: int, workers: int, first_core: int) -> list[int]:
    """Pin this worker to CPUs of its own when the node's `workers` fit in the CPUs it may run on;
    otherwise leave it to the scheduler. The CPUs it runs on.

    The CPUs are split into slots of `threads`, and the worker takes slot (first_core + local_rank)
    modulo their number, `first_core` being its job's first NeuronCore: the ranks of one job get
    slots of their own, and so do jobs on different cores of the same host (two one-core jobs on
    cores 0 and 1 run on different CPUs, not both on the first)."""
    allowed = sorted(os.sched_getaffinity(0))
    _UNPINNED[:] = allowed
    slots = len(allowed) // max(1, threads)
    if workers > slots:
        return allowed
    slot = (first_core + local_rank) % slots
    mine = allowed[slot * threads:(slot + 1) * threads]
    os.sched_setaffinity(0, mine)
    return mine


_UNPINNED: list[int] = []


def unpinned() -> list[int]:
    """The CPUs this process could run on before `pin_cpus` (empty when it was not called): a
    helper process of the worker's (the checkpoint writer) runs on those the worker did not take."""
    return list(_UNPINNED)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's `mallopt` parameters (malloc.h)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest dynamic threshold)."""
TRIM_THRESHOLD_BYTES = 128 << 20
"""Free memory at the top of the heap that a worker keeps rather than returns to the system."""


def steady_heap() -> bool:
    """Keep this process's heap from shrinking and growing again around every forward pass.

    glibc gives a block above its mmap threshold a mapping of its own, and returns the heap's free
    top to the system once it exceeds the trim threshold. Both start small (128 KiB and 256 KiB) and
    grow only as large blocks are freed, so a worker whose set-up freed only small ones maps or
    regrows the heap for each batch's activations (a few MiB) and takes a page fault for every page
    of them: 15% of a one-core inference's time went to system time that way. Fixed thresholds keep
    those blocks in the heap, at the cost of up to TRIM_THRESHOLD_BYTES kept free. False where the
    C library has no `mallopt` (not glibc), which changes nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)]
    return all(done)
