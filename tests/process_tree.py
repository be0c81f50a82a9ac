"""This host's processes as a tree, read from /proc: what the tests that check a process's
children (a job's, a server's) walk."""

from __future__ import annotations

import contextlib
from pathlib import Path


def descendants(root: int) -> set[int]:
    """The pids of every process below `root`, `root` itself left out. A process that ends while
    /proc is read is left out too."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        found |= more
        grew = bool(more)
    return found - {root}


def command_line(pid: int) -> bytes:
    """The process's command line, its arguments NUL-separated; empty once it has ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
