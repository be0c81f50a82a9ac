"""How a phase is launched on one host: torchrun, one worker process per NeuronCore, and the
Neuron runtime's view of which cores those are (NEURON_RT_VISIBLE_CORES).

Functions of the request and the environment, torch-free, that start nothing: the command and the
environment can be checked without running anything. The environment carries the same contract a
Trainium host gives its workers (NEURON_RT_VISIBLE_CORES, NEURON_CC_FLAGS and the compile cache they
name). The command runs torchrun through trnflow's launcher program, `python -m
trnflow.backends.launcher RANKS ...` (`LAUNCHER`), which lives with the backends that start it.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from trnflow.errors import FatalError
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec, instance

INSTANCE_CORES_ENV = "TRNFLOW_INSTANCE_CORES"
INSTANCE_TYPE_ENV = "TRNFLOW_INSTANCE_TYPE"
"""How many NeuronCores the instance has (the launcher sets it for the workers)."""
RANK_LOGS = "ranks"
"""The job folder's folder of per-rank logs and torchrun's exit record."""
WORKLOAD = "trnflow.workload"
"""The module every phase's ranks run (`python -m trnflow.workload PHASE`)."""
LAUNCHER = "trnflow.backends.launcher"
"""The launcher program every job's command runs (`python -m LAUNCHER RANKS <torchrun arguments>`),
named here, not imported: it is the backends' module."""


def format_cores(cores: list[int]) -> str:
    """`nc0-nc3` for a range, as the runtime prints it; `nc1,nc5` otherwise."""
    if cores and cores == list(range(cores[0], cores[-1] + 1)):
        return f"nc{cores[0]}-nc{cores[-1]}"
    return ",".join(f"nc{c}" for c in cores)


def parse_visible_cores(value: str) -> list[int]:
    """`NEURON_RT_VISIBLE_CORES` is a single index ("3") or an inclusive range ("0-7")."""
    text = value.strip()
    first, sep, last = text.partition("-")
    try:
        lo, hi = int(first), int(last) if sep else int(first)
    except ValueError:
        raise FatalError(f"NEURON_RT_VISIBLE_CORES={value!r}: expected an index (3) or a range (0-7)") from None
    if hi < lo:
        raise FatalError(f"NEURON_RT_VISIBLE_CORES={value!r}: the range ends before it starts")
    return list(range(lo, hi + 1))


def aligned_ranges(count: int, total: int, exclude: frozenset[int] = frozenset()) -> list[list[int]]:
    """Every contiguous range of `count` cores starting at a multiple of `count` (the runtime's
    placement rule for collective jobs) that avoids `exclude`, first to last."""
    if count > total:
        raise FatalError(f"{count} NeuronCores requested but the instance has {total}")
    step = count if total % count == 0 else 1
    ranges = [list(range(start, start + count)) for start in range(0, total - count + 1, step)]
    healthy = [cores for cores in ranges if not exclude.intersection(cores)]
    if not healthy:  # no waiting helps: the instance lacks healthy cores
        raise FatalError(
            f"only {total - len(exclude)} healthy NeuronCore(s) left after excluding "
            f"{format_cores(sorted(exclude))}; the job needs {count} contiguous ones. "
            "Replace the instance or lower compute.cores_per_node"
        )
    return healthy


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
        INSTANCE_TYPE_ENV: instance(itype).name,
    }
    if spec is not None:
        cache = compiler_cache_dir(spec.compile.cache_url)
        env |= {
            "NEURON_CC_FLAGS": f"--optlevel={spec.compile.optlevel} --cache_dir={cache}",
            "NEURON_COMPILE_CACHE_URL": cache,
            "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if spec.compute.precision == "bf16-sr" else "0",
        }
    return env


LOOPBACK = "127.0.0.1"
"""Where a one-host job's ranks meet: its rendezvous store and gloo listen on loopback only
(`trnflow.backends.launcher`), out of the network's reach."""


def launch_command(phase: str, processes: int, job_dir: Path, run_id: str, checkpoint: str | None = None,
                   with_spec: bool = True, with_options: bool = False, budget_usd: float | None = None) -> list[str]:
    argv = [
        sys.executable, "-m", LAUNCHER, str(job_dir / RANK_LOGS),
        "--standalone", "--local-addr", LOOPBACK, "--nnodes", "1", "--nproc-per-node", str(processes),
        "-m", WORKLOAD, phase,
        "--output", str(job_dir / "output"),
        "--run-id", run_id,
    ]
    if with_spec:
        argv += ["--spec", str(job_dir / "spec.json")]
    if with_options:
        argv += ["--options", str(job_dir / "options.json")]
    if checkpoint:
        argv += ["--checkpoint", checkpoint]
    return argv + budget_args(budget_usd)


def budget_args(budget_usd: float | None) -> list[str]:
    """The workload's arguments that give training its budget (none: no limit)."""
    return [] if budget_usd is None else ["--budget-usd", repr(float(budget_usd))]


PIN_CPUS_ENV = "TRNFLOW_PIN_CPUS"
"""Set to 1 when the spec gives threads_per_core: each worker pins itself to CPUs of its own
(`trnflow.workload.tuning.pin_cpus`)."""


def rank_threads(ranks: int) -> int:
    """The host threads each of a job's `ranks` gets by default: the host's CPUs (TRNFLOW_HOST_CPUS,
    else every CPU) shared evenly between them, at least one."""
    cpus = TrnflowSettings().host_cpus or os.cpu_count() or 1
    return max(1, cpus // max(1, ranks))


def launch_env(spec: JobSpec | None, cores: list[int], itype: str, base: dict[str, str] | None = None
               ) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # The host's CPUs shared between the cores: oversubscribed threads slow gloo training several-fold.
    threads = spec.compute.threads_per_core if spec is not None else None
    env["OMP_NUM_THREADS"] = str(threads or rank_threads(len(cores)))
    if threads:
        env[PIN_CPUS_ENV] = "1"
    else:
        env.pop(PIN_CPUS_ENV, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONSAFEPATH"] = "1"  # no rank puts the submitting folder on sys.path: nothing there is imported
    env.update(neuron_env(spec, cores, itype))
    return env


def compiler_cache_dir(url: str) -> str:
    """The compile cache as the Neuron compiler takes it (`--cache_dir`, NEURON_COMPILE_CACHE_URL):
    an s3:// URL, or a local folder as a path (the compiler reads no file:// URL)."""
    parsed = urlparse(url)
    return unquote(parsed.path) if parsed.scheme == "file" else url


def cache_url(default: str, env: dict[str, str] | None = None) -> str:
    """Where the persistent cache is, decided as the Neuron compiler wrapper does: `--cache_dir` in
    NEURON_CC_FLAGS, then NEURON_COMPILE_CACHE_URL, then `default` (the spec's compile.cache_url).
    A local folder comes back as a file:// URL, as specs name it."""
    env = os.environ if env is None else env
    found = next((f.split("=", 1)[1] for f in shlex.split(env.get("NEURON_CC_FLAGS", ""))
                  if f.startswith("--cache_dir=")), None) or env.get("NEURON_COMPILE_CACHE_URL") or default
    if urlparse(found).scheme:
        return found
    return Path(found).resolve().as_uri()


def retry_failed_requested(env: dict[str, str] | None = None) -> bool:
    """`--retry_failed_compilation` in NEURON_CC_FLAGS, as on Neuron."""
    env = os.environ if env is None else env
    return "--retry_failed_compilation" in shlex.split(env.get("NEURON_CC_FLAGS", ""))


def neuron_devices_here(dev: Path = Path("/dev")) -> bool:
    """Whether this host has Neuron devices (/dev/neuron0, ...): a Trainium or Inferentia instance."""
    return any(dev.glob("neuron[0-9]*"))
