"""How the emulator launches a phase: torchrun, one worker process per emulated NeuronCore.

Pure functions of the request, so the command and environment can be checked without running
anything. The environment carries the same contract a Trainium host gives its workers.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from trnflow.emulator import faults as fault_injection
from trnflow.emulator.cores import INSTANCE_CORES_ENV
from trnflow.errors import FatalError
from trnflow.specs import JobSpec, instance


def visible_cores_value(cores: list[int]) -> str:
    """NEURON_RT_VISIBLE_CORES takes one index or one inclusive range."""
    if cores != list(range(cores[0], cores[-1] + 1)):
        raise FatalError(f"NeuronCores {cores} are not one contiguous range; NEURON_RT_VISIBLE_CORES needs one")
    return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"


def neuron_env(spec: JobSpec | None, cores: list[int], itype: str) -> dict[str, str]:
    """The Neuron runtime and compiler variables a job sees."""
    env = {
        "NEURON_RT_VISIBLE_CORES": visible_cores_value(cores),
        "NEURON_RT_NUM_CORES": str(len(cores)),
        INSTANCE_CORES_ENV: str(instance(itype).cores),
    }
    if spec is not None:
        cache = spec.compile.cache_url
        env |= {
            "NEURON_CC_FLAGS": f"--optlevel={spec.compile.optlevel} --cache_dir={cache}",
            "NEURON_COMPILE_CACHE_URL": cache,
            "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if spec.compute.precision == "bf16-sr" else "0",
        }
    return env


def launch_command(phase: str, processes: int, job_dir: Path, run_id: str, checkpoint: str | None = None,
                   with_spec: bool = True, with_options: bool = False) -> list[str]:
    argv = [
        sys.executable, "-m", "torch.distributed.run",
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes),
        "-m", "trnflow.workload", phase,
        "--output", str(job_dir / "output"),
        "--run-id", run_id,
    ]
    if with_spec:
        argv += ["--spec", str(job_dir / "spec.json")]
    if with_options:
        argv += ["--options", str(job_dir / "options.json")]
    if checkpoint:
        argv += ["--checkpoint", checkpoint]
    return argv


def launch_env(spec: JobSpec | None, cores: list[int], itype: str, base: dict[str, str] | None = None
               ) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # One host thread per emulated core: oversubscribed threads slow gloo training several-fold.
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // len(cores)))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(neuron_env(spec, cores, itype))
    fault_injection.parse(env.get(fault_injection.FAULTS_ENV, ""))  # a malformed list fails before launch
    return env
