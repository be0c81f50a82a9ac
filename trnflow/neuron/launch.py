"""How a phase is launched on one host: torchrun, one worker process per NeuronCore, and the
Neuron runtime's view of which cores those are (NEURON_RT_VISIBLE_CORES).

Pure functions of the request, torch-free, so the command and environment can be checked without
running anything. The environment carries the same contract a Trainium host gives its workers.

The command is torchrun run by `python -m trnflow.neuron.launch RANKS ...` (`main`), which keeps
each rank's output in a log of its own under RANKS (torchrun's `--log-dir`, `--redirects 3`) and,
when ranks fail, writes how each one ended (exit code or signal, and when) to RANKS/exits.json: the
only place a rank killed without a word is known by name, and by the signal that ended it. On
Linux, on a host without Neuron devices (the emulator's), the launcher forks the workload's ranks
(`forks_ranks`): they start with torch, and what the workload's `preload` imports, already loaded.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import unquote, urlparse

from trnflow.errors import FatalError
from trnflow.fsutil import atomic_write_json
from trnflow.specs import JobSpec, instance

INSTANCE_CORES_ENV = "TRNFLOW_INSTANCE_CORES"
INSTANCE_TYPE_ENV = "TRNFLOW_INSTANCE_TYPE"
"""How many NeuronCores the instance has (the launcher sets it for the workers)."""
RANK_LOGS = "ranks"
"""The job folder's folder of per-rank logs and torchrun's exit record."""
EXITS = "exits.json"
"""torchrun's record of the ranks that ended non-zero, in RANK_LOGS."""
WORKLOAD = "trnflow.workload"
"""The module every phase's ranks run (`python -m trnflow.workload PHASE`)."""
RANK_START_ENV = "TRNFLOW_RANK_START"
"""`exec` makes each rank a new interpreter, as plain torchrun starts it; by default (`fork`) the
launcher forks the workload's ranks, on Linux."""


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


def launch_command(phase: str, processes: int, job_dir: Path, run_id: str, checkpoint: str | None = None,
                   with_spec: bool = True, with_options: bool = False) -> list[str]:
    argv = [
        sys.executable, "-m", "trnflow.neuron.launch", str(job_dir / RANK_LOGS),
        "--standalone", "--nnodes", "1", "--nproc-per-node", str(processes),
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
    return argv


PIN_CPUS_ENV = "TRNFLOW_PIN_CPUS"
"""Set to 1 when the spec gives threads_per_core: each worker pins itself to CPUs of its own."""


def pin_cpus(local_rank: int, threads: int, workers: int, first_core: int) -> list[int]:
    """Pin this worker to CPUs of its own when the node's `workers` fit in the CPUs it may run on;
    otherwise leave it to the scheduler. The CPUs it runs on.

    The CPUs are split into slots of `threads`, and the worker takes slot (first_core + local_rank)
    modulo their number, `first_core` being its job's first NeuronCore: the ranks of one job get
    slots of their own, and so do jobs on different cores of the same host (two one-core jobs on
    cores 0 and 1 run on different CPUs, not both on the first)."""
    allowed = sorted(os.sched_getaffinity(0))
    slots = len(allowed) // max(1, threads)
    if workers > slots:
        return allowed
    slot = (first_core + local_rank) % slots
    mine = allowed[slot * threads:(slot + 1) * threads]
    os.sched_setaffinity(0, mine)
    return mine


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's `mallopt` parameters (malloc.h)."""
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from the heap (glibc's largest dynamic threshold)."""
TRIM_THRESHOLD_BYTES = 128 << 20
"""Free memory at the top of the heap that a worker keeps rather than returns to the system."""


def steady_heap() -> bool:
    """Keep this process's heap from shrinking and growing again around every forward pass.

    glibc gives a block above its mmap threshold a mapping of its own, and returns the heap's free
    top to the system once it exceeds the trim threshold. Both start small (128 KiB and 256 KiB) and
    grow only as large blocks are freed, so a worker whose set-up freed only small ones maps or
    regrows the heap for each batch's activations (a few MiB) and takes a page fault for every page
    of them: 15% of a one-core inference's time went to system time that way. Fixed thresholds keep
    those blocks in the heap, at the cost of up to TRIM_THRESHOLD_BYTES kept free. False where the
    C library has no `mallopt` (not glibc), which changes nothing."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = [mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)]
    return all(done)


def launch_env(spec: JobSpec | None, cores: list[int], itype: str, base: dict[str, str] | None = None
               ) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    # The host's CPUs shared between the cores: oversubscribed threads slow gloo training several-fold.
    threads = spec.compute.threads_per_core if spec is not None else None
    env["OMP_NUM_THREADS"] = str(threads or max(1, (os.cpu_count() or 1) // len(cores)))
    if threads:
        env[PIN_CPUS_ENV] = "1"
    else:
        env.pop(PIN_CPUS_ENV, None)
    env["PYTHONUNBUFFERED"] = "1"
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


def rank_logs(folder: Path, local_rank: int) -> Path | None:
    """The folder torchrun keeps a rank's stdout.log and stderr.log in (under `--log-dir`), or None
    (none there: the ranks wrote to the launcher's output, `--console`)."""
    found = sorted(p for p in folder.glob(f"*/attempt_*/{local_rank}")
                   if (p / "stdout.log").exists() or (p / "stderr.log").exists())
    return found[-1] if found else None


def exits_record(folder: Path, failures: dict, ended: dict[int, tuple[int, int, float]] | None = None) -> dict:
    """torchrun's failures (its `ChildFailedError.failures`: rank -> ProcessFailure) as exits.json
    holds them: each rank's exit code (negative: the signal), when torchrun saw it end, its logs.
    `ended` (local rank -> pid, exit code, when seen; from `keep_every_exit`) adds the ranks that
    ended non-zero which torchrun did not name: of forked ranks it names only the first it saw."""
    found = {rank: (f.local_rank, f.pid, f.exitcode, f.timestamp) for rank, f in failures.items()}
    offset = next((rank - f.local_rank for rank, f in failures.items()), 0)  # this node's first rank
    named = {f.local_rank for f in failures.values()}
    for local_rank, (pid, exitcode, seen) in (ended or {}).items():
        if exitcode and local_rank not in named:
            found[offset + local_rank] = (local_rank, pid, exitcode, seen)
    ranks = []
    for rank, (local_rank, pid, exitcode, seen) in sorted(found.items()):
        logs = rank_logs(folder, local_rank)
        ranks.append({"rank": rank, "local_rank": local_rank, "pid": pid, "exitcode": exitcode,
                      "observed": seen, "logs": str(logs) if logs else ""})
    return {"ranks": ranks}


def keep_every_exit() -> dict[int, tuple[int, int, float]]:
    """How every forked rank ended (local rank -> pid, exit code, when seen), filled in when one of
    them fails. torchrun names only the first failed rank it sees among forked ones, which may be a
    peer that reported the lost link in the same instant as the rank that was killed; run as a
    subprocess, every rank that ended non-zero is named. Call it in the launcher, before its ranks
    start: their ProcessContext (torch's, which joins forked processes) then records them all."""
    # torch: only the launcher process loads it (the module; `torch.multiprocessing.spawn` is also a function)
    spawn = importlib.import_module("torch.multiprocessing.spawn")
    ended: dict[int, tuple[int, int, float]] = {}

    class Recorded(spawn.ProcessContext):
        def join(self, timeout=None, grace_period=None):
            try:
                return super().join(timeout, grace_period)
            except (spawn.ProcessRaisedException, spawn.ProcessExitedException):
                seen = time.time()  # every process has been joined (or ended) by now
                ended.clear()
                ended.update({i: (p.pid, p.exitcode, seen) for i, p in enumerate(self.processes)})
                raise

    spawn.ProcessContext = Recorded
    return ended


def neuron_devices_here(dev: Path = Path("/dev")) -> bool:
    """Whether this host has Neuron devices (/dev/neuron0, ...): a Trainium or Inferentia instance."""
    return any(dev.glob("neuron[0-9]*"))


def forks_ranks(module: str | None, env: dict[str, str] | None = None, devices: bool | None = None) -> bool:
    """Whether the launcher forks the ranks of `-m module` (the workload, on Linux, unless
    TRNFLOW_RANK_START=exec) rather than starting each as a new interpreter. On a host with Neuron
    devices (`devices`, by default looked up) each rank starts as a program of its own, as the Neuron
    SDK's torchrun launches it: a launcher that imported torch has loaded the SDK's plug-in too, and
    nothing documents the Neuron runtime in a process forked from one."""
    env = os.environ if env is None else env
    devices = neuron_devices_here() if devices is None else devices
    return (module == WORKLOAD and sys.platform.startswith("linux") and env.get(RANK_START_ENV, "fork") != "exec"
            and not devices)


CONSOLE = "--console"
"""The launcher's own option, before RANKS: the ranks write to the launcher's stdout and stderr (a
container's log stream) instead of logs of their own."""


def main(argv: list[str]) -> None:
    """`python -m trnflow.neuron.launch [--console] RANKS <torchrun arguments>`: torchrun, with each
    rank's output in its own log under RANKS (or, with `--console`, in the launcher's own output)
    and, when ranks fail, how each ended in RANKS/exits.json. torchrun's own output, error and exit
    status are left as they are."""
    # torch: only the launcher process loads it
    from torch.distributed import run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

    console = argv[:1] == [CONSOLE]
    folder = Path(argv[1 if console else 0])
    folder.mkdir(parents=True, exist_ok=True)
    # torchrun's own files (its error files) go under RANKS either way, not into a temporary folder
    logs = ["--log-dir", str(folder)] + ([] if console else ["--redirects", "3"])
    args = run.parse_args([*logs, *argv[2 if console else 1:]])
    forked = forks_ranks(args.training_script if args.module else None)
    ended = keep_every_exit() if forked else {}
    try:
        record(_run_forked if forked else run.run)(args)
    except ChildFailedError as exc:
        atomic_write_json(folder / EXITS, exits_record(folder, exc.failures, ended))
        raise


def _run_forked(args) -> None:
    """torchrun's `run`, with each rank forked from this launcher (torchrun's agent runs a function
    entrypoint with `--start-method fork`) instead of started as `python -m MODULE`: a rank then
    finds torch, and what the module's `preload` loads, already imported, seconds of start-up each.
    The rendezvous is set up as torchrun's own `run` sets it up."""
    # torch: only the launcher process loads it
    from torch.distributed import run
    from torch.distributed.launcher.api import elastic_launch

    args.start_method = "fork"
    one_node_static = (args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None
                       and run.parse_min_max_nnodes(args.nnodes)[1] == 1)
    if args.standalone or one_node_static:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = run.config_from_args(args)
    module = importlib.import_module(f"{args.training_script}.__main__")
    module.preload(list(args.training_script_args))
    elastic_launch(config=config, entrypoint=_rank)(args.training_script, *args.training_script_args)


def _rank(module: str, *argv: str) -> int:
    """One rank, forked from the launcher, run as `python -m module argv...` would run it: Python's
    own signal handlers back (torchrun's, inherited, would turn its SIGTERM into an exception the
    rank reports as its failure), none of the launcher's exit handlers, and the rank's own run
    before it leaves (multiprocessing ends a forked process without running them). A non-zero
    exit code is the process's, as torchrun sees it."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    atexit._clear()
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(f"{module}.__main__").main(list(argv))
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    if code:
        raise SystemExit(code)
    return 0


if __name__ == "__main__":
    main(sys.argv[1:])
