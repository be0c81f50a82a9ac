"""A warm start for local jobs: one process per submitting process that has loaded torchrun once,
and forks each job's supervisor.

Started cold, a local job's supervisor and launcher cost about 3.3 CPU-s before the first rank
starts, nearly all of it torchrun's import of torch; a pipeline runs a dozen jobs. The fork server
pays that once. The backend sends it each job (its folder and environment) over a socket; it forks
the job's supervisor in a process group of its own, with that environment, and answers with its pid. The
supervisor forks the launcher in turn (see `local_runner`), torch already loaded.

The server lives as long as the process that started it: when the socket closes, however that
process ended, the server exits, and the supervisors it forked, their parent gone, end their jobs
as they would on their submitter's death. The server reaps the supervisors, so none is left a
zombie. The environment travels over the socket and is never written down.

Linux only: macOS does not support forking a process that has loaded system frameworks (torch does)
without starting a new program, so there the backend starts each supervisor cold.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from trnflow.backends import local_runner
from trnflow.backends.launcher import forks_ranks
from trnflow.device.signing import SIGNING_KEY_ENV
from trnflow.neuron.launch import WORKLOAD

SUPPORTED = sys.platform.startswith("linux")
"""Where the backend uses the fork server."""


class ForkServer:
    """The submitting side: starts the server, sends it jobs, stops it at exit."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", __name__, str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                # the cache's signing key is the compile job's alone: its request brings it, nothing else holds it
                env={**{k: v for k, v in os.environ.items() if k != SIGNING_KEY_ENV}, "PYTHONUNBUFFERED": "1"})
        self._socket = ours
        self._conn = ours.makefile("rwb")
        self.owner = os.getpid()

    def alive(self) -> bool:
        return self._proc.poll() is None

    def start(self, job_dir: Path, env: dict[str, str]) -> int:
        """Fork the supervisor of the job in `job_dir`, with `env` as its environment; its pid."""
        request = {"job_dir": str(job_dir), "submitter": os.getpid(), "env": env}
        try:
            self._conn.write(json.dumps(request).encode() + b"\n")
            self._conn.flush()
            reply = self._conn.readline()
        except OSError:
            reply = b""
        if not reply:
            raise RuntimeError(f"trnflow's local fork server ended (exit code {self._proc.poll()}) before starting "
                               f"the job in {job_dir}; submit it again")
        answer = json.loads(reply)
        if "error" in answer:
            raise RuntimeError(f"could not start the job in {job_dir}: {answer['error']}")
        return int(answer["pid"])

    def stop(self, timeout: float = 5.0) -> None:
        """Close the socket, which ends the server, and reap it."""
        self._conn.close()
        self._socket.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_SERVER: ForkServer | None = None
_LOCK = threading.Lock()  # one request at a time: a flow's tasks submit from several threads


def start_supervisor(job_dir: Path, env: dict[str, str]) -> int:
    """Fork the supervisor of the job in `job_dir` from this process's fork server, started at the
    first job (and again, should it have ended); the supervisor's pid."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.owner != os.getpid() or not _SERVER.alive():
            if _SERVER is None:
                atexit.register(_stop)
            _SERVER = ForkServer()
        return _SERVER.start(job_dir, env)


def _stop() -> None:
    if _SERVER is not None and _SERVER.owner == os.getpid():
        _SERVER.stop()


def serve(fd: int) -> None:
    """The server: fork a supervisor for each request on the socket `fd`, until it closes."""
    from torch.distributed import run  # noqa: F401  torch: loaded once here, for every job's launcher
    from torch.distributed.elastic.multiprocessing import errors  # noqa: F401  what the launcher uses

    forking = forks_ranks(WORKLOAD)  # looks for Neuron devices: once
    if forking:  # the ranks will be forked from the launchers forked from here
        from trnflow.workload.__main__ import preload  # torch and TorchDynamo: once here, for every job's ranks

        preload(["train"])  # what every phase's ranks import, and TorchDynamo, which the compiling phases use

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the supervisors: no zombies
    server = os.getpid()
    with socket.socket(fileno=fd) as sock, sock.makefile("rwb") as conn:
        for line in conn:
            request = json.loads(line)
            if forking:
                _preload(Path(request["job_dir"]))
            try:
                pid = os.fork()
            except OSError as exc:
                reply = {"error": str(exc)}
            else:
                if pid == 0:
                    _supervise(sock, request, server)
                with contextlib.suppress(OSError):  # the child does the same: whichever runs first
                    os.setpgid(pid, pid)  # so the group `cancel` signals exists before the pid is sent
                reply = {"pid": pid}
            conn.write(json.dumps(reply).encode() + b"\n")
            conn.flush()


def _preload(job_dir: Path) -> None:
    """The libraries the job's recipe builds its model with, imported here once (one of trnflow's own
    recipes: see `preload_recipe`), so that this job's ranks and every later job's find them loaded."""
    from trnflow.workload.__main__ import preload_recipe  # the workload: torch, which only the server loads

    try:
        phase = json.loads((job_dir / "job.json").read_text())["phase"]
    except (OSError, ValueError, KeyError):
        return
    preload_recipe(phase, job_dir / "spec.json", own_only=True)


def _supervise(sock: socket.socket, request: dict, server: int) -> None:
    """In the forked child: become the job's supervisor, then exit. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the supervisor waits for its launcher
        os.close(sock.detach())  # the server's end of the socket is not the job's to hold
        os.setpgid(0, 0)  # a process group of its own, which `cancel` ends whole (see `local`)
        os.environ.clear()
        os.environ.update(request["env"])
        code = local_runner.main(request["job_dir"], request["submitter"], parent=server)
    except BaseException:
        with open(Path(request["job_dir"]) / "job.log", "a") as log:  # the server's own output goes nowhere
            traceback.print_exc(file=log)
    finally:
        os._exit(code)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
