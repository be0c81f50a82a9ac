"""Supervises one local job: runs its command, then records the exit code in `exit.json`.

It inherits the job's environment from the backend, so credentials are never written to disk.

torchrun keeps each rank's output in a log of its own (`ranks/`, see `trnflow.neuron.launch`), so
that a failure can quote the rank that failed; the supervisor copies those lines into `job.log` as
they come, whole lines at a time, so `job.log` still holds everything the job printed.

Started by the local backend in its own session, so `cancel` can end the whole process group at
once. The job belongs to the process that submitted it: if that process dies (a flow process
killed with SIGKILL, say), nobody will read the job's result, so the job is ended too. Its cores
are then free for the flow's rerun, which resumes from the job's last checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import BinaryIO

from trnflow.fsutil import atomic_write_json
from trnflow.neuron.launch import RANK_LOGS

ORPHANED = -int(signal.SIGKILL)
"""The exit code recorded for a job whose submitter died: the job was killed."""


class RankLogs:
    """Copies what each rank writes to its own logs (`<folder>/<run>/attempt_<n>/<rank>/std*.log`)
    into the job's log, whole lines only until the end, so no line of one rank is cut by another's."""

    def __init__(self, folder: Path, log: BinaryIO):
        self.folder, self.log = folder, log
        self.copied: dict[Path, int] = {}

    def copy(self, final: bool = False) -> None:
        logs = self.folder.glob("*/attempt_*/*/std*.log")
        for path in sorted(logs, key=lambda p: (p.parent, p.name != "stdout.log")):  # a rank's error after its output
            done = self.copied.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(done)
                data = fh.read()
            end = len(data) if final else data.rfind(b"\n") + 1
            if end:
                self.log.write(data[:end] + (b"" if data[:end].endswith(b"\n") else b"\n"))
                self.copied[path] = done + end


def main(job_dir: str, submitter: int, poll_seconds: float = 0.25) -> int:
    root = Path(job_dir)
    job = json.loads((root / "job.json").read_text())
    began = time.time()
    with open(root / "job.log", "ab", buffering=0) as log:  # the environment is inherited, never read from disk
        proc = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT, cwd=job["cwd"])
        ranks = RankLogs(root / RANK_LOGS, log)
        while True:
            try:
                code = proc.wait(timeout=poll_seconds)
                ranks.copy(final=True)  # all of it, before exit.json says the job ended
                break
            except subprocess.TimeoutExpired:
                ranks.copy()
                if os.getppid() != submitter:  # reparented: the submitter is gone
                    log.write(f"trnflow: the process that submitted this job ({submitter}) is gone; "
                              "ending the job\n".encode())
                    _end_group(proc)
                    ranks.copy(final=True)
                    atomic_write_json(root / "exit.json", {"exit_code": ORPHANED, "started": began,
                                                           "ended": time.time(), "orphaned": True})
                    os.killpg(os.getpgid(0), signal.SIGKILL)  # anything left, and this supervisor
    atomic_write_json(root / "exit.json", {"exit_code": code, "started": began, "ended": time.time()})
    return 0


def _end_group(proc: subprocess.Popen, grace_seconds: float = 10.0) -> None:
    """SIGTERM the job's process group (this supervisor excepted) and wait for the launcher, so
    that the job's cores are free by the time `exit.json` says it ended."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgid(0), signal.SIGTERM)
    try:
        proc.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        proc.kill()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
