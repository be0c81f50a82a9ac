"""The instances of one job attempt, on this machine: one container process per node, each in its
own process group and with its own emulated devices, and their output copied into CloudWatch Logs
as the services' log drivers do."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trnflow.testing.mockcloud.warm import SUPPORTED, WarmProcess
from trnflow.testing.mockcloud.warm import start as warm_start

ENTRYPOINT = [sys.executable, "-m", "trnflow.backends.container"]
"""The training image's entrypoint."""
WARM = SUPPORTED
"""Whether containers are forked from the warm start server (see `warm`) rather than started cold."""
CHILD_GRACE_SECONDS = 30
"""How long the other nodes may take to end after the main node has."""
PASSED_THROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR", "TRNFLOW_FAULTS",
                  "TRNFLOW_HOST_CPUS")
"""What a container inherits from this machine: enough to run the image's Python, nothing else (and
the share of this machine's CPUs its jobs may use, as local jobs are given it)."""
NODE_MARK = "TRNFLOW_MOCK_NODE"
"""Set in a container's environment and inherited by everything it starts, even processes that
leave its process group (torchrun starts each worker in a session of its own): a killed node's
processes are found by it, as a cgroup would hold them."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class Node:
    args: list[str]
    """The container's arguments after the image's entrypoint (`train`, `batch`)."""
    env: dict[str, str]
    log: Path
    stream: str
    """CloudWatch log stream for the node's output."""
    proc: subprocess.Popen | WarmProcess | None = field(default=None, repr=False)

    mark: str = field(default_factory=lambda: uuid.uuid4().hex)

    def start(self, warm: bool | None = None) -> None:
        """Start the container: forked from the mock cloud's warm start server (`warm`), which is the
        default on Linux, or as a program of its own (also when its PYTHONPATH is not the server's)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.env, NODE_MARK: self.mark}
        if warm if warm is not None else WARM:
            self.proc = warm_start(ENTRYPOINT[1:] + self.args, env, self.log, NODE_MARK, PASSED_THROUGH)
            if self.proc is not None:
                return
        with open(self.log, "ab", buffering=0) as out:
            self.proc = subprocess.Popen([*ENTRYPOINT, *self.args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self) -> None:
        """Stop the instance: the container and every process it started, wherever they went."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for _ in range(5):  # again, for anything forked while the last round was being killed
            left = marked_processes(self.mark)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)


def marked_processes(mark: str) -> list[int]:
    """The processes whose environment carries this node's mark."""
    needle = b"\0" + f"{NODE_MARK}={mark}".encode() + b"\0"
    proc = Path("/proc")
    found: list[int] = []
    if not proc.is_dir():  # not Linux: the process group is all there is
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in b"\0" + environ:
            found.append(int(entry.name))
    return found


class LogPump(threading.Thread):
    """Copies new complete lines of each node's log file into its CloudWatch stream."""

    def __init__(self, group: str, nodes: list[Node], logs: Any):
        super().__init__(daemon=True)
        self.group, self.nodes = group, nodes
        self._logs = logs
        self._offsets = {n.stream: 0 for n in nodes}
        self._done = threading.Event()
        exists = logs.exceptions.ResourceAlreadyExistsException
        with contextlib.suppress(exists):
            logs.create_log_group(logGroupName=group)
        for node in nodes:
            with contextlib.suppress(exists):
                logs.create_log_stream(logGroupName=group, logStreamName=node.stream)

    def _copy(self) -> None:
        for node in self.nodes:
            if not node.log.exists():
                continue
            with open(node.log, "rb") as fh:
                fh.seek(self._offsets[node.stream])
                data = fh.read()
            end = data.rfind(b"\n") + 1
            if not end:
                continue
            self._offsets[node.stream] += end
            now = int(time.time() * 1000)
            lines = data[:end].decode("utf-8", errors="replace").splitlines()
            for i in range(0, len(lines), 500):
                events = [{"timestamp": now, "message": line or " "} for line in lines[i:i + 500]]
                self._logs.put_log_events(logGroupName=self.group, logStreamName=node.stream, logEvents=events)

    def run(self) -> None:
        while not self._done.wait(0.5):
            self._copy()

    def finish(self) -> None:
        self._done.set()
        self.join()
        self._copy()


@dataclass(frozen=True)
class Notice:
    """An interruption that warns first: SIGTERM to every container, which may take up to
    `grace_seconds` to end (a spot reclaim notice gives two minutes), then the instances go."""

    reason: str
    grace_seconds: float = 120.0


def run_nodes(nodes: list[Node], group: str, logs: Any, interrupt: Callable[[], str | Notice | None]
              ) -> tuple[list[int | None], str | None, float]:
    """Start every node and wait for all of them. `interrupt()` is asked twice a second; when it
    returns a reason, every node is killed (after its `Notice`, when it gives one). Returns the exit
    codes (None for a killed node), the interrupting reason, and the wall seconds the attempt held
    its instances."""
    pump = LogPump(group, nodes, logs)
    began = time.time()
    for node in nodes:
        node.start()
    pump.start()
    reason = None
    main = nodes[0].proc
    assert main is not None
    try:
        while main.poll() is None:  # the job ends with its main node, as on both services
            asked = interrupt()
            if isinstance(asked, Notice):
                _notify(nodes, asked.grace_seconds)
                asked = asked.reason
            reason = asked
            if reason is not None:
                break
            time.sleep(0.5)
        deadline = time.monotonic() + CHILD_GRACE_SECONDS
        while reason is None and time.monotonic() < deadline and any(
                n.proc is not None and n.proc.poll() is None for n in nodes):
            time.sleep(0.2)
    finally:
        for node in nodes:
            node.kill()
        pump.finish()
    codes: list[int | None] = [None if reason else n.proc.returncode for n in nodes if n.proc is not None]
    return codes, reason, time.time() - began


def _notify(nodes: list[Node], grace_seconds: float) -> None:
    """SIGTERM each container (its first process, as the service signals it) and wait up to
    `grace_seconds` for all of them to end."""
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline and any(n.proc is not None and n.proc.poll() is None for n in nodes):
        time.sleep(0.2)


def container_env(endpoint_url: str, region: str, *layers: dict[str, Any]) -> dict[str, str]:
    """A container's environment: the image's Python, the emulated AWS endpoint with placeholder
    credentials, then `layers` in order (the job's variables, then the service's)."""
    env = {k: v for k, v in os.environ.items() if k in PASSED_THROUGH}
    env |= {"AWS_ENDPOINT_URL": endpoint_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": region, "PYTHONUNBUFFERED": "1"}
    for layer in layers:
        env |= {k: str(v) for k, v in layer.items()}
    return env
