"""Processes on this host, as trnflow's lock and job records name them: whether one still runs.

One answer for every record that names a process by its pid: a compile-cache entry's lock, a
retraining slot's holder, a local job's supervisor, an emulator rank's private folder. A pid is
only a number: once its process has ended, the system may give it to a new process, which then
counts as alive here, so what the record named looks held until that process ends too. Records
therefore also name their host, and a reader on another host goes by the record's age instead.
"""

from __future__ import annotations

import os

MAX_PID = 2**22
"""The largest pid any Linux system hands out (its `pid_max` cannot be set higher); macOS's are smaller."""


def pid_alive(pid: int, ours: bool = False) -> bool:
    """Whether process `pid` runs on this host. Another user's process counts as alive, unless
    `ours` (the caller's own process is meant, so another user's at that pid is not it). A number no
    process can have (a record's garbled or crafted pid) is no live process."""
    if not 0 < pid <= MAX_PID:  # 0 and -1 would ask about a process group, or every process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return not ours
    return True
