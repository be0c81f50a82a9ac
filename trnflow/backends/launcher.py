"""trnflow's launcher program: torchrun, as every job's command runs it (`python -m
trnflow.backends.launcher [--console] RANKS <torchrun arguments>`, built by
`trnflow.neuron.launch.launch_command` and by the container's entrypoint).

It keeps each rank's output in a log of its own under RANKS (torchrun's `--log-dir`, `--redirects 3`)
and, when ranks fail, writes how each one ended (exit code or signal, and when) to RANKS/exits.json:
the only place a rank killed without a word is known by name, and by the signal that ended it. On
Linux, on a host without Neuron devices (the emulator's), the launcher forks the workload's ranks
(`forks_ranks`): they start with torch, and what the workload's `preload` imports, already loaded.

A store the ranks meet at on a loopback address (`--standalone`, `--local-addr 127.0.0.1`: every
one-host job of the local backend) listens on loopback, as does gloo: torch's TCPStore listens on
every interface whatever host it is given, so the launcher binds its socket itself
(`loopback_stores`).

The local backend's supervisor runs it in a fork of itself (`local_runner`); a container runs it as
a program. torch is imported only inside the functions that run torchrun, so the backends that build
and read its files (`failures`, `trnflow.backends.container`) load none of it.
"""

from __future__ import annotations

import atexit
import importlib
import ipaddress
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from trnflow.fsutil import atomic_write_json
from trnflow.neuron.launch import WORKLOAD, neuron_devices_here

EXITS = "exits.json"
"""torchrun's record of the ranks that ended non-zero, in the job's RANK_LOGS folder."""
RANK_START_ENV = "TRNFLOW_RANK_START"
"""`exec` makes each rank a new interpreter, as plain torchrun starts it; by default (`fork`) the
launcher forks the workload's ranks, on Linux."""


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



def is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine's loopback address (an address, or a name that resolves to one)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0]).is_loopback
    except (OSError, ValueError, IndexError):
        return False


def loopback_interface() -> str:
    """The loopback interface's name (`lo` on Linux, `lo0` on macOS), for GLOO_SOCKET_IFNAME."""
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return min(names, key=len) if names else "lo"


def loopback_stores() -> None:
    """Make every TCPStore server this process (and its forked ranks) starts on a loopback host listen
    on that address alone. torch's server listens on all interfaces, whatever host it is named by,
    unless it is handed a socket that listens already (`master_listen_fd`): this binds one."""
    # torch: only the launcher process loads it
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    if getattr(dist.TCPStore, "loopback_only", False):
        return

    class LoopbackTCPStore(dist.TCPStore):
        loopback_only = True

        def __init__(self, host_name, port, *args, **kwargs):
            is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
            if is_master and kwargs.get("master_listen_fd") is None and is_loopback(host_name):
                found = socket.getaddrinfo(host_name, port, type=socket.SOCK_STREAM)
                family, _, _, _, address = min(found, key=lambda a: a[0] != socket.AF_INET)  # 127.0.0.1 first
                listener = socket.socket(family, socket.SOCK_STREAM)
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(address)
                listener.listen(socket.SOMAXCONN)
                port = listener.getsockname()[1]
                kwargs["master_listen_fd"] = listener.detach()  # the store owns and closes it
            super().__init__(host_name, port, *args, **kwargs)

    for module in (dist, c10d_rendezvous_backend, static_tcp_rendezvous):
        module.TCPStore = LoopbackTCPStore


CONSOLE = "--console"
"""The launcher's own option, before RANKS: the ranks write to the launcher's stdout and stderr (a
container's log stream) instead of logs of their own."""


def main(argv: list[str]) -> None:
    """`python -m trnflow.backends.launcher [--console] RANKS <torchrun arguments>`: torchrun, with each
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
    loopback_stores()
    if is_loopback(args.local_addr):  # one host: its ranks' gloo connections stay on it too
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
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
    atexit._clear()  # private to CPython (no public call drops the handlers a fork inherited): checked in
    # tests/unit/test_private_torch.py with PyTorch's private APIs
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
