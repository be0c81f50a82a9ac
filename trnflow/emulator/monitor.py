"""What `trnflow top` shows: per emulated core, its owner, utilisation and memory held.

A core's owner is the worker process holding its lock; utilisation is that process's CPU time
over the sampling interval and memory is its resident set, read from /proc.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from trnflow.emulator.cores import holders
from trnflow.specs import instance

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime


def _rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        return None
    return None


class CoreMonitor:
    def __init__(self, itype: str):
        self.itype = instance(itype)

    def sample(self, interval: float) -> list[dict]:
        """One row per core, utilisation measured over `interval` seconds."""
        before = {core: h for core, h in holders(self.itype.cores).items()}
        cpu0 = {core: _cpu_seconds(h["pid"]) for core, h in before.items() if h.get("pid")}
        began = time.monotonic()
        time.sleep(interval)
        elapsed = time.monotonic() - began
        rows = []
        for core in range(self.itype.cores):
            holder = before.get(core)
            row = {"core": core, "device": core // self.itype.cores_per_chip, "pid": None, "command": None,
                   "utilization": 0.0, "memory_bytes": 0,
                   "memory_limit_bytes": self.itype.core_memory_bytes}
            if holder and holder.get("pid"):
                pid = holder["pid"]
                start, end = cpu0.get(core), _cpu_seconds(pid)
                busy = (end - start) / elapsed if start is not None and end is not None else 0.0
                row |= {"pid": pid, "command": holder.get("command"), "utilization": round(100 * min(busy, 1.0), 1),
                        "memory_bytes": _rss_bytes(pid) or 0}
            rows.append(row)
        return rows
