"""Supervises one local job: runs its command, then records the exit code in `exit.json`.

It inherits the job's environment from the backend, so credentials are never written to disk.

Started by the local backend in its own session, so the job outlives nothing it should not and
`cancel` can end the whole process group at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from trnflow.fsutil import atomic_write_json


def main(job_dir: str) -> int:
    root = Path(job_dir)
    job = json.loads((root / "job.json").read_text())
    began = time.time()
    with open(root / "job.log", "ab", buffering=0) as log:  # the environment is inherited, never read from disk
        code = subprocess.call(job["argv"], stdout=log, stderr=subprocess.STDOUT, cwd=job["cwd"])
    atomic_write_json(root / "exit.json", {"exit_code": code, "started": began, "ended": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
