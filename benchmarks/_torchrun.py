"""Running a bare baseline script under torchrun and reading the JSON line its rank 0 prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def torchrun_json(script: str, ranks: int, *args: object) -> dict:
    """`torchrun --standalone --nproc-per-node RANKS benchmarks/SCRIPT ARGS...`, one thread per rank;
    returns the first JSON object printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(HERE / script), *map(str, args)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    found = next((line for line in done.stdout.splitlines() if line.startswith("{")), None)
    if done.returncode != 0 or found is None:  # say why, so a rare failure can be traced to its cause
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-120:])
        raise SystemExit(f"{' '.join(argv[2:])} exited {done.returncode}:\n{tail}")
    return json.loads(found)
