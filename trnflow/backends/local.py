"""The local backend: runs each phase on the NeuronCore emulator, as torchrun-launched processes.

Every job gets a folder under the settings' jobs directory:

    job.json      the command and environment (the request, as sent)
    spec.json     the job spec the workers read
    job.log       everything the workers print
    ranks/        each rank's own stdout.log and stderr.log (torchrun's log folder) and, when
                  ranks failed, exits.json: how each one ended
    output/       result.json from rank 0, failure-rank<r>.json from failing ranks
    exit.json     written by the supervisor when the job ends
    cancelled     written by cancel()
    interrupt     written by interrupt(): the supervisor sends the launcher SIGTERM

A job belongs to the process that submitted it, which waits for it: if that process dies, the job
is ended too (see `local_runner`), so its cores are free for a rerun. On Linux each job's supervisor
is forked from the submitting process's fork server, which has torch loaded (see `forkserver`);
elsewhere, or with `warm_start=False`, it starts as a new process.

Each job's supervisor leads a process group of its own, which `cancel` ends whole and a Ctrl-C at
the submitter's terminal does not reach. It stays in the submitter's session: Linux shares the CPU
between sessions first (one scheduling autogroup each), so a job in a session of its own took a
full share beside its submitter's other work, whatever `nice` the submitter ran at.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from trnflow.backends import forkserver, machine
from trnflow.backends.base import JobDetails, JobInfo, JobRequest, JobState, fitted, stage_result
from trnflow.backends.failures import name_first_rank, read_exits, read_reports, root_failure
from trnflow.backends.local_runner import INTERRUPT
from trnflow.backends.teams import cache_key_env
from trnflow.device.base import Device
from trnflow.device.registry import get_device
from trnflow.device.signing import SIGNING_KEY_ENV
from trnflow.errors import FatalError, TransientError
from trnflow.fsutil import atomic_write_json, atomic_write_text
from trnflow.neuron.launch import RANK_LOGS, aligned_ranges, launch_command, launch_env, parse_visible_cores
from trnflow.processes import pid_alive
from trnflow.results import FailureReport
from trnflow.specs import instance
from trnflow.teams import UNDECLARED, Team

# job.json records only the variables that describe the job; everything else (credentials among
# it) reaches the workers by inheritance and is never written down.
_RECORDED = ("NEURON_", "TRNFLOW_", "OMP_", "PYTHON", "TORCH", "FI_", "SM_", "AWS_BATCH_JOB_")


log = logging.getLogger("trnflow.backends")
WAIT_POLL_SECONDS = 1.0
"""How often a job waiting for busy NeuronCores looks again."""


def _recorded(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in sorted(env.items()) if k.startswith(_RECORDED)}


class LocalBackend:
    name = "local"
    shares_allocation = False  # this machine places each job's cores
    picks_instance_type = True  # one machine: nothing to choose among

    @staticmethod
    def outputs(job_id: str) -> None:
        """A local job's nodes leave nothing to follow while it runs: its folder has its result."""
        return None

    def __init__(self, jobs_dir: Path, device: Device | None = None, warm_start: bool = forkserver.SUPPORTED,
                 team: Team = UNDECLARED):
        self.jobs_dir = jobs_dir
        self.team = team
        """The team of this machine's runs: a declared team's jobs use its cache keys, never the machine's."""
        self.device = device or get_device()
        self.warm_start = warm_start
        self._procs: dict[str, subprocess.Popen] = {}

    def _dir(self, job_id: str) -> Path:
        path = self.jobs_dir / job_id
        if not (path / "job.json").is_file():
            raise KeyError(f"no local job {job_id!r} under {self.jobs_dir}")
        return path

    def _place(self, request: JobRequest) -> list[int]:
        """The cores the job runs on: as requested, as the caller's environment pins them, or the
        first free aligned range that avoids excluded cores: within the cores its run holds in this
        machine's queue (`machine`), off those other runs hold."""
        total = instance(request.itype).cores
        if request.cores:
            return list(request.cores)
        found = machine.entries()  # read once: the cores this job's run holds, and those others hold
        mine = machine.held_by(request.run_id, found)
        pinned = os.environ.get("NEURON_RT_VISIBLE_CORES")
        if pinned:
            cores = parse_visible_cores(pinned)
            if len(cores) < request.world_size:
                raise FatalError(f"NEURON_RT_VISIBLE_CORES={pinned} gives {len(cores)} core(s) but the job needs "
                                 f"{request.world_size}; widen the range or unset it")
            return cores[: request.world_size]
        allowed = os.environ.get("NEURON_RT_NUM_CORES")
        if allowed and allowed != "0" and int(allowed) < request.world_size:
            raise FatalError(f"NEURON_RT_NUM_CORES={allowed} allows fewer cores than the {request.world_size} "
                             "the job needs; raise it or unset it")
        bad = request.exclude_cores
        if mine is not None:
            try:  # on the cores it holds, off the bad ones (a job on fewer cores than the run holds fits there)
                return self.device.allocate(request.world_size, total, bad | (frozenset(range(total)) - set(mine)))
            except FatalError:
                held = machine.ticket(request.run_id)
                if not bad & set(mine) or held is None:
                    raise
            mine = held.move(bad)  # the run holds other cores instead of the bad ones
            return self.device.allocate(request.world_size, total, bad | (frozenset(range(total)) - set(mine)))
        others = machine.reserved(excluding=request.run_id, found=found)
        healthy = aligned_ranges(request.world_size, total, bad)  # hardware short of cores: said as such
        if all(others.keys() & set(cores) for cores in healthy):
            raise TransientError("held by runs in this machine's queue: " + "; ".join(
                f"nc{core} by run {run}" for core, run in sorted(others.items())))
        return self.device.allocate(request.world_size, total, bad | frozenset(others))

    def _free_cores(self, request: JobRequest) -> list[int]:
        """The job's cores (`_place`) once no other process holds them. Busy cores are waited for
        up to `compute.max_pending_minutes`, as a cloud job waits for capacity, with a log line
        naming who holds them; after that the job fails as transient (retried)."""
        limit = request.spec.compute.max_pending_minutes * 60 if request.spec else 0.0
        deadline, told = time.monotonic() + limit, False
        total = instance(request.itype).cores
        while True:
            try:
                cores = self._place(request)
                held = self.device.busy(cores, total)
            except TransientError as exc:  # no free range of cores at all
                cores, held = [], str(exc)
            if held is None:
                return cores
            if time.monotonic() >= deadline:
                waited = f" after waiting {limit / 60:g} min (compute.max_pending_minutes)" if limit else ""
                raise TransientError(f"{request.phase}: the NeuronCores it needs are busy{waited}: {held}")
            if not told:
                log.warning("%s of run %s waits up to %g min for its NeuronCores: %s", request.phase, request.run_id,
                            limit / 60, held)
                told = True
            time.sleep(WAIT_POLL_SECONDS)

    def submit(self, request: JobRequest) -> str:
        request = fitted(request)  # refuse a job that cannot fit before anything starts
        spec = request.spec
        cores = self._free_cores(request)
        job_id = f"{request.name}-{request.phase}-{uuid.uuid4().hex[:8]}"
        job_dir = self.jobs_dir / job_id
        (job_dir / "output").mkdir(parents=True)
        if spec is not None:
            atomic_write_text(job_dir / "spec.json", spec.model_dump_json(indent=2))
        if request.options:
            atomic_write_json(job_dir / "options.json", request.options)
        argv = launch_command(request.phase, len(cores), job_dir, request.run_id, request.checkpoint,
                              with_spec=spec is not None, with_options=bool(request.options),
                              budget_usd=request.budget_usd)
        env = launch_env(spec, cores, request.itype)  # the run id goes as the program's --run-id
        for key, value in cache_key_env(self.team).items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        if request.phase != "compile":  # the cache's signing key is the compile stage's alone
            env.pop(SIGNING_KEY_ENV, None)
        self.device.check_launch_env(env)
        record = {"job_id": job_id, "phase": request.phase, "run_id": request.run_id, "argv": argv,
                  "cwd": os.getcwd(), "processes": len(cores), "cores": cores}
        atomic_write_json(job_dir / "job.json", {**record, "env": _recorded(env)})
        if self.warm_start:
            pid = forkserver.start_supervisor(job_dir, env)  # reaped by the fork server
        else:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "trnflow.backends.local_runner", str(job_dir), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                process_group=0, env=env,  # a group of its own, in this session (above)
            )
            pid = proc.pid
            self._procs[job_id] = proc
        atomic_write_json(job_dir / "pid.json", {"pid": pid})
        return job_id

    def _reap(self, job_id: str) -> None:
        """Collect the exit status of a job's supervisor once the job has ended: it exits as soon as
        `exit.json` is written, and a process that submits many jobs (a flow, a benchmark) must not
        keep one finished child per job as a zombie."""
        proc = self._procs.pop(job_id, None)
        if proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # still closing down: reaped at the next look
                self._procs[job_id] = proc

    def _alive(self, job_id: str, job_dir: Path) -> bool:
        proc = self._procs.get(job_id)
        if proc is not None:
            return proc.poll() is None
        try:
            pid = json.loads((job_dir / "pid.json").read_text())["pid"]
        except FileNotFoundError:
            return False
        return pid_alive(pid, ours=True)  # the supervisor is this user's: another's at that pid is not it

    def describe(self, job_id: str) -> JobInfo:
        job_dir = self._dir(job_id)
        if (job_dir / "cancelled").exists():
            return JobInfo(job_id, JobState.CANCELLED)
        exit_file = job_dir / "exit.json"
        if not exit_file.exists():
            if self._alive(job_id, job_dir) or exit_file.exists():
                return JobInfo(job_id, JobState.RUNNING)
            return JobInfo(job_id, JobState.FAILED, failure=FailureReport(
                type="WorkerLost", retryable=True, message="the job's supervisor process died before the job ended"))
        exit_info = json.loads(exit_file.read_text())
        self._reap(job_id)
        if exit_info.get("orphaned"):
            return JobInfo(job_id, JobState.FAILED, failure=FailureReport(
                type="FatalError", retryable=False,
                message="the job was ended because the process that submitted it died"))
        details = JobDetails(exit_code=exit_info["exit_code"], seconds=exit_info["ended"] - exit_info["started"],
                             cores=json.loads((job_dir / "job.json").read_text())["cores"])
        result_file = job_dir / "output" / "result.json"
        if exit_info["exit_code"] == 0 and result_file.exists():
            return JobInfo(job_id, JobState.SUCCEEDED, result=stage_result(job_id, result_file.read_bytes(),
                                                                         details.cores), details=details)
        return JobInfo(job_id, JobState.FAILED, failure=self._root_failure(job_dir, exit_info), details=details)

    def _root_failure(self, job_dir: Path, exit_info: dict) -> FailureReport:
        """The failure that caused the others: a rank's own error before its peers' broken links.

        A rank that died without a word (SIGKILL, the OOM killer) leaves only its peers' errors
        about the lost connection: that is a lost worker, which a retry can cure. torchrun's record
        of how the ranks ended tells the rank that failed first from those it stopped afterwards:
        the failure names that rank, its exit code or signal and the last lines of its log. Without
        that record (the launcher itself was killed), the job log's last lines stand in.
        """
        processes = json.loads((job_dir / "job.json").read_text())["processes"]
        exits = read_exits(job_dir / RANK_LOGS)
        failure = root_failure(read_reports(job_dir / "output"), processes, exits=exits)
        if exits and (processes > 1 or failure.type == "WorkerLost"):
            return name_first_rank(failure, exits)
        if failure.type == "WorkerLost":
            tail = "\n".join(self.logs(job_dir.name)[0].splitlines()[-15:])
            why = f"exit code {exit_info['exit_code']}; killed, or out of memory"
            failure = failure.model_copy(
                update={"message": f"rank(s) {failure.ranks} exited without reporting why ({why})\n{tail}"})
        return failure

    def logs(self, job_id: str, since: int = 0) -> tuple[str, int]:
        """Complete log lines from byte offset `since`, and the offset after them."""
        path = self._dir(job_id) / "job.log"
        if not path.exists():
            return "", since
        with open(path, "rb") as fh:
            fh.seek(since)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next call
        return data[:end].decode("utf-8", errors="replace"), since + end

    def interrupt(self, job_id: str) -> None:
        """Ask the job to stop as a service stops one: its supervisor sends its launcher SIGTERM,
        which torchrun passes to every rank; training checkpoints at its next step boundary and ends
        (`Interrupted`)."""
        atomic_write_text(self._dir(job_id) / INTERRUPT, "")

    def stop_command(self, job_id: str) -> str:
        """The command that stops the job's process group, for a person to run when trnflow could not."""
        try:
            pid = json.loads((self._dir(job_id) / "pid.json").read_text())["pid"]
        except (FileNotFoundError, KeyError):
            return f"kill the processes of {self.jobs_dir / job_id}"
        return f"kill -KILL -- -{pid}"

    def cancel(self, job_id: str, grace_seconds: float = 10.0) -> None:
        """Stop the job's whole process group: SIGTERM, then SIGKILL after `grace_seconds`."""
        job_dir = self._dir(job_id)
        atomic_write_text(job_dir / "cancelled", "")
        try:
            pid = json.loads((job_dir / "pid.json").read_text())["pid"]
        except FileNotFoundError:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace_seconds
            while time.monotonic() < deadline:
                proc = self._procs.get(job_id)
                if proc is not None:
                    proc.poll()  # reap our own child, or its group never empties
                try:
                    os.killpg(pid, 0)
                except ProcessLookupError:
                    return
                time.sleep(0.1)
