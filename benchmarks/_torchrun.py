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
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(HERE / script), *map(str, args)],
        env=env, check=True, capture_output=True, text=True,
    ).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("{")))
