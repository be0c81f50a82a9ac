"""How the emulator launches a phase: torchrun, one worker process per emulated NeuronCore.

A pure function of the request, so the command and environment can be checked without running
anything. The environment carries the same contract a Trainium host gives its workers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from jobspecs import JobSpec


def neuron_env(spec: JobSpec, processes: int) -> dict[str, str]:
    """The Neuron runtime and compiler variables a job on this spec sees."""
    cache = spec.compile.cache_url
    return {
        "NEURON_RT_VISIBLE_CORES": "0" if processes == 1 else f"0-{processes - 1}",
        "NEURON_RT_NUM_CORES": str(processes),
        "NEURON_CC_FLAGS": f"--optlevel={spec.compile.optlevel} --cache_dir={cache}",
        "NEURON_COMPILE_CACHE_URL": cache,
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if spec.compute.precision == "bf16-sr" else "0",
    }


def launch_command(phase: str, processes: int, job_dir: Path, run_id: str,
                   checkpoint: str | None = None) -> list[str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes),
        "-m", "trnflow.workload", phase,
        "--spec", str(job_dir / "spec.json"),
        "--output", str(job_dir / "output"),
        "--run-id", run_id,
    ]
    if checkpoint:
        argv += ["--checkpoint", checkpoint]
    return argv


def launch_env(spec: JobSpec, processes: int, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # One host thread per emulated core: oversubscribed threads slow gloo training several-fold.
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // processes))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(neuron_env(spec, processes))
    return env
