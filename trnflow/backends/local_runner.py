"""Supervises one local job: runs its launcher, then records the exit code in `exit.json`.

It inherits the job's environment from the backend, so credentials are never written to disk.

The launcher, torchrun (`trnflow.backends.launcher`), is a fork of this supervisor running the job's
command line, its output and errors into `job.log`. A supervisor forked from the backend's fork
server (see `forkserver`) has torch loaded already, so its launcher starts without loading it again.

torchrun keeps each rank's output in a log of its own (`ranks/`, see `trnflow.backends.launcher`), so
that a failure can quote the rank that failed; the supervisor copies those lines into `job.log` as
they come, whole lines at a time, so `job.log` still holds everything the job printed.

Started by the local backend as the leader of a process group of its own, so `cancel` can end the
whole group at once. The job belongs to the process that submitted it: if that process dies (a flow process
killed with SIGKILL, say), nobody will read the job's result, so the job is ended too. Its cores
are then free for the flow's rerun, which resumes from the job's last checkpoint. The supervisor
knows by its parent: the submitter itself, or the fork server, which ends with the submitter.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO, NoReturn

from trnflow.backends.forked import run_as_program
from trnflow.backends.launcher import main as run_torchrun
from trnflow.fsutil import atomic_write_json
from trnflow.neuron.launch import LAUNCHER, RANK_LOGS

INTERRUPT = "interrupt"
"""The file in a job's folder that asks its supervisor to send the launcher SIGTERM (the job is asked
to stop, as a service asks a container: training checkpoints at its next step boundary)."""
ORPHANED = -int(signal.SIGKILL)
"""The exit code recorded for a job whose submitter died: the job was killed."""


class RankLogs:
    """Copies what each rank writes to its own logs (`<folder>/<run>/attempt_<n>/<rank>/std*.log`)
    into the job's log, whole lines only until the end, so no line of one rank is cut by another's."""

    def __init__(self, folder: Path, log: BinaryIO):
        self.folder, self.log = folder, log
        self.copied: dict[Path, int] = {}

    def copy(self, final: bool = False) -> None:
        logs = self.folder.glob("*/attempt_*/*/std*.log")
        for path in sorted(logs, key=lambda p: (p.parent, p.name != "stdout.log")):  # a rank's error after its output
            done = self.copied.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(done)
                data = fh.read()
            end = len(data) if final else data.rfind(b"\n") + 1
            if end:
                self.log.write(data[:end] + (b"" if data[:end].endswith(b"\n") else b"\n"))
                self.copied[path] = done + end


def main(job_dir: str, submitter: int, parent: int | None = None, poll_seconds: float = 0.25) -> int:
    """Run the job in `job_dir` to its end. `parent` is the process whose end ends the job (the
    fork server, when it forked this supervisor); by default the submitter, which started it."""
    root = Path(job_dir)
    job = json.loads((root / "job.json").read_text())
    watched = submitter if parent is None else parent
    began = time.time()
    with open(root / "job.log", "ab", buffering=0) as log:  # the environment is inherited, never read from disk
        launcher = Launcher(job, log)
        ranks = RankLogs(root / RANK_LOGS, log)
        asked = False
        while (code := launcher.wait(poll_seconds)) is None:
            ranks.copy()
            if not asked and (root / INTERRUPT).exists():
                log.write(b"trnflow: the job is asked to stop: SIGTERM to its launcher\n")
                os.kill(launcher.pid, signal.SIGTERM)
                asked = True
            if os.getppid() != watched:  # reparented: the submitter is gone
                log.write(f"trnflow: the process that submitted this job ({submitter}) is gone; "
                          "ending the job\n".encode())
                _end_group(launcher)
                ranks.copy(final=True)
                atomic_write_json(root / "exit.json", {"exit_code": ORPHANED, "started": began,
                                                       "ended": time.time(), "orphaned": True})
                os.killpg(os.getpgid(0), signal.SIGKILL)  # anything left, and this supervisor
        ranks.copy(final=True)  # all of it, before exit.json says the job ended
    atomic_write_json(root / "exit.json", {"exit_code": code, "started": began, "ended": time.time()})
    return 0


class Launcher:
    """torchrun for the job: a fork of this process running `trnflow.backends.launcher` with the job's
    command line, in the job's working folder, its output and errors into `log`. Its exit code comes
    as a process's would: negative for the signal that ended it."""

    def __init__(self, job: dict, log: BinaryIO):
        argv = job["argv"]
        if argv[1:3] != ["-m", LAUNCHER]:
            raise ValueError(f"job.json: the command must run {LAUNCHER}, not {argv[1:3]}")
        self.pid = os.fork()
        if self.pid == 0:
            _run_launcher(argv[3:], job["cwd"], log.fileno())
        self._status: list[int] = []
        self._waiter = threading.Thread(target=self._reap, daemon=True)
        self._waiter.start()

    def _reap(self) -> None:
        self._status.append(os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1]))

    def wait(self, timeout: float) -> int | None:
        """The exit code, once the launcher has ended within `timeout` seconds; else None."""
        self._waiter.join(timeout)
        return self._status[0] if self._status else None


def _run_launcher(args: list[str], cwd: str, log_fd: int) -> NoReturn:
    """In the forked child: torchrun's run to its end, then exit as `python -m` would. Never returns."""
    def body() -> None:
        os.chdir(cwd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        run_torchrun(args)

    run_as_program(body)


def _end_group(launcher: Launcher, grace_seconds: float = 10.0) -> None:
    """SIGTERM the job's process group (this supervisor excepted) and wait for the launcher, so
    that the job's cores are free by the time `exit.json` says it ended."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(os.getpgid(0), signal.SIGTERM)
    if launcher.wait(grace_seconds) is None:
        os.kill(launcher.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
