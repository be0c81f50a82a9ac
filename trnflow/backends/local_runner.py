"""Supervises one local job: runs its command, then records the exit code in `exit.json`.

It inherits the job's environment from the backend, so credentials are never written to disk.

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

from trnflow.fsutil import atomic_write_json

ORPHANED = -int(signal.SIGKILL)
"""The exit code recorded for a job whose submitter died: the job was killed."""


def main(job_dir: str, submitter: int, poll_seconds: float = 0.5) -> int:
    root = Path(job_dir)
    job = json.loads((root / "job.json").read_text())
    began = time.time()
    with open(root / "job.log", "ab", buffering=0) as log:  # the environment is inherited, never read from disk
        proc = subprocess.Popen(job["argv"], stdout=log, stderr=subprocess.STDOUT, cwd=job["cwd"])
        while True:
            try:
                code = proc.wait(timeout=poll_seconds)
                break
            except subprocess.TimeoutExpired:
                if os.getppid() != submitter:  # reparented: the submitter is gone
                    log.write(f"trnflow: the process that submitted this job ({submitter}) is gone; "
                              "ending the job\n".encode())
                    _end_group(proc)
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
