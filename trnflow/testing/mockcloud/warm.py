"""A warm start for the mock cloud's containers: one process per mock cloud that has loaded what a
container and its launcher load (torch, TorchDynamo, the workload's modules, boto3), and forks each
container from there.

Started cold, a container costs about 3 CPU-s of imports for each phase it launches, and a cloud
pipeline starts a dozen; a forked one starts with all of it loaded, and forks its launcher in turn
(`trnflow.backends.container.start_launcher`). A real service starts its containers cold, as the
mock cloud did: the container's code is the same either way.

The container runs as `python ENTRYPOINT ARGS` would (`-m module` or `-c code`), in a session of its
own, with the node's environment and its output into the node's log. The server answers each start
with the container's pid, and reports each container's exit code when it ends, since only the server
can wait for it.

Each node's processes are found by their node's mark (`nodes.NODE_MARK`), which
/proc/<pid>/environ shows: the environment a program started with, which a forked process shares
with the program it was forked from. The server starts with a placeholder mark of the same length
in its environment, and each forked container writes its node's mark over the placeholder
(`_stamp`), so that its launcher and ranks, forked from it, carry the mark as a cold container's
do. Linux only (it reads /proc); elsewhere the nodes start cold.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import queue
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import NoReturn

from trnflow.backends import container  # noqa: F401  the containers' own code, loaded once
from trnflow.backends.forked import run_as_program
from trnflow.backends.launcher import forks_ranks
from trnflow.neuron.launch import WORKLOAD

SUPPORTED = sys.platform.startswith("linux")
MARK_LENGTH = 32
"""A node's mark: a uuid4's hex digits."""
PLACEHOLDER = "0" * MARK_LENGTH
"""The mark in the server's environment, which each container overwrites with its node's."""


class WarmProcess:
    """A container forked by the server, as much of `subprocess.Popen` as the nodes use."""

    def __init__(self, pid: int, server: WarmStart):
        self.pid, self._server = pid, server
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._server.exit_code(self.pid, wait=True, timeout=timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"container {self.pid}", timeout or 0)
        self.returncode = code
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)


def _ended(pid: int) -> bool:
    """Whether the process is gone, or a zombie nobody has reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class WarmStart:
    """The submitting side: starts the server, sends it containers to start, and keeps their exit codes."""

    START_SECONDS = 300.0
    """How long a start may take: the first waits for the server to load torch, on a busy machine."""

    def __init__(self, mark_variable: str, passed_through: tuple[str, ...]) -> None:
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if k in passed_through}
        self.python_path = env.get("PYTHONPATH")
        """What the server's Python finds modules with: a node that sets another starts cold."""
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-P", "-m", __name__, str(theirs.fileno()), mark_variable],
                pass_fds=(theirs.fileno(),), start_new_session=True,  # not stopped by a Ctrl-C meant for its user
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**env, "PYTHONUNBUFFERED": "1", mark_variable: PLACEHOLDER})
        self._socket = ours
        self._conn = ours.makefile("rwb")
        self.owner = os.getpid()
        self._answers: queue.Queue[dict] = queue.Queue()
        self._requests = 0
        self._codes: dict[int, int] = {}
        self._ended = threading.Condition()
        self._gone = False
        threading.Thread(target=self._read, daemon=True, name="warm-start").start()

    def alive(self) -> bool:
        return self._proc.poll() is None and not self._gone

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: `stop` closed the socket meanwhile
            for line in self._conn:
                answer = json.loads(line)
                with self._ended:
                    if "exited" in answer:
                        self._codes[answer["exited"]] = answer["code"]
                        self._ended.notify_all()
                        continue
                    if "pid" in answer:  # a pid used again: its earlier container's end was reported first
                        self._codes.pop(answer["pid"], None)
                self._answers.put(answer)
        with self._ended:  # the server is gone: its containers can no longer be waited for
            self._gone = True
            self._ended.notify_all()
        self._answers.put({"error": f"the warm start server ended (exit code {self._proc.poll()})"})

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> WarmProcess:
        """Fork `python ARGV` (`-m module ...` or `-c code ...`) with `env`, its output into `log`, in
        this process's working folder."""
        self._requests += 1
        request = {"id": self._requests, "argv": argv, "env": env, "log": str(log), "cwd": os.getcwd()}
        self._conn.write(json.dumps(request).encode() + b"\n")
        self._conn.flush()
        deadline = time.monotonic() + self.START_SECONDS
        while True:
            try:
                answer = self._answers.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"the warm start server did not start a container within {self.START_SECONDS:.0f} s"
                                   ) from None
            if answer.get("id", request["id"]) == request["id"]:
                break
            if "pid" in answer:  # the answer to a start given up on: nobody waits for that container
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(answer["pid"], signal.SIGKILL)
        if "error" in answer:
            raise RuntimeError(f"could not start the container: {answer['error']}")
        return WarmProcess(int(answer["pid"]), self)

    def exit_code(self, pid: int, wait: bool = False, timeout: float | None = None) -> int | None:
        """The container's exit code once the server saw it end (negative for a signal); None before.
        Once the server is gone, a container that ended counts as killed: its code went with it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._ended:
            if wait:
                self._ended.wait_for(lambda: pid in self._codes or self._gone, timeout)
            while pid not in self._codes and self._gone:
                if _ended(pid):
                    self._codes[pid] = -signal.SIGKILL
                elif not wait or (deadline is not None and time.monotonic() >= deadline):
                    break
                else:
                    self._ended.wait(0.1)
            return self._codes.get(pid)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the socket, which ends the server, and reap it."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)  # first: the reader's end of file, and its lock let go
            self._conn.close()
            self._socket.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_SERVER: WarmStart | None = None
_LOCK = threading.Lock()  # one start at a time: the services' jobs start their nodes from several threads


def start(argv: list[str], env: dict[str, str], log: Path, mark_variable: str,
          passed_through: tuple[str, ...]) -> WarmProcess | None:
    """Fork a container from this process's warm start server, started at the first container (and
    again, should it have ended); None when the node's Python would find other modules than the
    server's (another PYTHONPATH), which only a cold start gives it."""
    global _SERVER
    with _LOCK:
        if _SERVER is None or _SERVER.owner != os.getpid() or not _SERVER.alive():
            if _SERVER is None:
                atexit.register(_stop)
            _SERVER = WarmStart(mark_variable, passed_through)
        if env.get("PYTHONPATH") != _SERVER.python_path:
            return None
        return _SERVER.start(argv, env, log)


def _stop() -> None:
    if _SERVER is not None and _SERVER.owner == os.getpid():
        _SERVER.stop()


def serve(fd: int, mark_variable: str) -> None:
    """The server: fork a container for each request on the socket `fd`, and report each one's end,
    until the socket closes. A request comes only once the one before it was answered, so a line
    never waits unseen in the reader's buffer."""
    _preload()
    with socket.socket(fileno=fd) as sock, sock.makefile("rwb") as conn:
        def say(answer: dict) -> None:
            conn.write(json.dumps(answer).encode() + b"\n")
            conn.flush()

        while True:
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                line = conn.readline()
                if not line:
                    return
                request = json.loads(line)
                say({"id": request["id"], **_fork(sock, request, mark_variable)})
            with contextlib.suppress(ChildProcessError):
                while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                    say({"exited": ended[0], "code": os.waitstatus_to_exitcode(ended[1])})


def _fork(sock: socket.socket, request: dict, mark_variable: str) -> dict:
    """Fork the container, and answer once it is in its own session with its node's mark, as a
    cold container is once `Popen` returns: a kill can reach it from then on."""
    ready, told = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(ready)
        os.close(told)
        return {"error": str(exc)}
    if pid == 0:
        os.close(ready)
        _container(sock, request, mark_variable, told)
    os.close(told)
    with os.fdopen(ready, "rb") as pipe:
        pipe.read()  # the end of file: the child closed its end, or ended
    return {"pid": pid}


def _preload() -> None:
    """What every container and launcher would import for itself."""
    # torch and boto3, slow to import: loaded here, in the server, for every container it forks
    import boto3  # noqa: F401  the containers' and the ranks' S3 and the services' clients
    from torch.distributed import run  # noqa: F401  the launcher's torchrun
    from torch.distributed.elastic.multiprocessing import errors  # noqa: F401

    if forks_ranks(WORKLOAD):
        from trnflow.workload.__main__ import preload  # the workload's modules: torch

        preload(["train"])  # what every phase's ranks import, and TorchDynamo


def _container(sock: socket.socket, request: dict, mark_variable: str, ready: int) -> NoReturn:
    """In the forked child: become the container, then exit as `python ARGV` would. Never returns."""
    def body() -> None:
        os.close(sock.detach())  # the server's end of the socket is not the container's to hold
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.setsid()  # a session and process group of its own, as a cold container has
        _stamp(mark_variable, request["env"][mark_variable])
        os.close(ready)  # the server may answer: the container can be killed whole from here on
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path.insert(0, request["cwd"])  # as `python -m` and `-c` put the working folder first
        option, target, *args = request["argv"]
        if option == "-m":
            sys.argv = [target, *args]
            # the module was loaded ahead, which is the point: runpy's warning that it was is not the container's
            warnings.filterwarnings("ignore", "'.*' found in sys.modules after import", RuntimeWarning)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102  the node's own entrypoint

    run_as_program(body)


def _stamp(variable: str, mark: str) -> None:
    """Write `mark` over the placeholder value of `variable` in the environment this process's
    program started with (the block between /proc/self/stat's env_start and env_end), which
    /proc/<pid>/environ shows for it and for every process forked from it."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # fields 50 and 51 of proc(5); the list starts at field 3
    block = b"\0" + ctypes.string_at(start, end - start)
    at = block.find(f"\0{variable}={PLACEHOLDER}\0".encode())
    if at < 0 or len(mark) != MARK_LENGTH:
        raise RuntimeError(f"the warm start server's environment has no placeholder {variable} to overwrite")
    ctypes.memmove(start + at + len(variable) + 1, mark.encode(), MARK_LENGTH)  # `at` counts the leading NUL


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
