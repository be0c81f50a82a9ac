"""The local backend runs real torchrun process groups on the emulator."""

import json
import os
import time

import pytest

from tests.sdk_tools import NCCOM_TEST, fake_neuron_ls, fake_tool
from trnflow.backends import Backend, JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def test_local_backend_satisfies_the_protocol(backend):
    assert isinstance(backend, Backend)


def test_sanity_job_runs_one_process_per_core_with_the_neuron_contract(backend, make_spec, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary-secret-value")
    spec = make_spec()
    job_id = backend.submit(JobRequest(spec, "sanity", "t1"))
    info = wait(backend, job_id, 0.2)
    assert info.state is JobState.SUCCEEDED, backend.logs(job_id)[0]
    assert [c.core for c in info.result.per_core] == [0, 1]
    assert info.result.bad_cores == []
    swept = info.result.collectives.rows  # trnflow's own sweep names its columns as nccom-test does
    stored = [row.model_dump(mode="json") for row in swept]
    assert swept and all(row["time:avg(us)"] > 0 and "time(us)" not in row for row in stored)
    job_dir = backend.jobs_dir / job_id
    record = json.loads((job_dir / "job.json").read_text())
    assert record["env"]["NEURON_RT_VISIBLE_CORES"] == "0-1"
    assert "AWS_SECRET_ACCESS_KEY" not in record["env"]
    assert not any("canary-secret-value" in p.read_text(errors="replace") for p in job_dir.rglob("*") if p.is_file())
    assert record["argv"][1:4] == ["-m", "trnflow.backends.launcher", str(job_dir / "ranks")]  # torchrun, wrapped
    job_log = [json.loads(line) for line in (job_dir / "job.log").read_text().splitlines() if line.startswith("{")]
    for rank in (0, 1):  # each rank's output in its own log, and all of it, whole lines, in the job's
        own = next((job_dir / "ranks").glob(f"*/attempt_0/{rank}/stdout.log")).read_text()
        assert f'"event": "sanity", "rank": {rank}' in own
        assert any(e["event"] == "sanity" and e["rank"] == rank for e in job_log)


def test_failing_job_reports_its_root_cause(backend, make_spec, tmp_path):
    spec = make_spec(cores=1, data={"train": str(tmp_path / "missing")})
    info = wait(backend, backend.submit(JobRequest(spec, "train", "t2")), 0.2)
    assert info.state is JobState.FAILED
    assert info.failure.type == "DataError"
    assert info.failure.retryable is False
    assert "missing" in info.failure.message



@pytest.mark.parametrize("warm_start", [True, False], ids=["fork-server", "cold"])
def test_a_finished_job_leaves_no_zombie_behind(trnflow_home, make_spec, warm_start):
    """Each job's supervisor is reaped once its job ends (a flow or benchmark submits hundreds of
    jobs): by the fork server that forked it, or by the submitting process that started it cold."""
    backend = LocalBackend(TrnflowSettings().jobs_dir, warm_start=warm_start)
    ended = [wait(backend, backend.submit(JobRequest(make_spec(cores=1), "sanity", f"z{i}")), 0.2) for i in range(2)]
    assert [info.state for info in ended] == [JobState.SUCCEEDED] * 2
    for job_id in (info.job_id for info in ended):
        pid = json.loads((backend.jobs_dir / job_id / "pid.json").read_text())["pid"]
        deadline = time.monotonic() + 10
        while _process_state(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _process_state(pid) is None  # gone: neither running nor a zombie


def test_jobs_submitted_from_two_threads_at_once_and_after_the_fork_server_died_all_run(backend, make_spec):
    """A flow's tasks may submit from several threads: the fork server takes one request at a time.
    A server that has died (killed, say) is replaced at the next submission."""
    from concurrent.futures import ThreadPoolExecutor

    from trnflow.backends import forkserver

    spec = make_spec(cores=1)
    with ThreadPoolExecutor(2) as pool:
        ids = list(pool.map(lambda core: backend.submit(JobRequest(spec, "sanity", f"thread{core}", cores=(core,))),
                            (0, 1)))
    assert [wait(backend, job_id, 0.2).state for job_id in ids] == [JobState.SUCCEEDED] * 2
    server = forkserver._SERVER._proc
    server.kill()
    server.wait()
    again = wait(backend, backend.submit(JobRequest(spec, "sanity", "after")), 0.2)
    assert again.state is JobState.SUCCEEDED, backend.logs(again.job_id)[0]
    assert forkserver._SERVER._proc.pid != server.pid


def _process_state(pid: int) -> str | None:
    """The state letter of process `pid` (Z: a zombie), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None


def _parent_command(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        parent = fh.read().rpartition(")")[2].split()[1]
    with open(f"/proc/{parent}/cmdline", "rb") as fh:
        return fh.read().replace(b"\0", b" ").decode()


def test_cancel_ends_the_whole_process_group(backend, make_spec):
    spec = make_spec(1, train={"steps": 100_000, "checkpoint_every": 100_000})
    job_id = backend.submit(JobRequest(spec, "train", "t3"))
    deadline = time.monotonic() + 60
    while '"event": "data"' not in backend.logs(job_id)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = json.loads((backend.jobs_dir / job_id / "pid.json").read_text())["pid"]
    assert "-m trnflow.backends.forkserver" in _parent_command(pid)  # forked warm, torch loaded once per submitter
    backend.cancel(job_id)
    assert backend.describe(job_id).state is JobState.CANCELLED
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing of the job is left


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_ranks_are_forked_from_their_launcher_unless_told_to_start_as_programs(backend, make_spec, monkeypatch,
                                                                             start):
    """Forked, a rank is in its job's process group (and has torch from the launcher); with
    TRNFLOW_RANK_START=exec it is `python -m trnflow.workload`, in a session of its own, as torchrun
    starts it."""
    from trnflow.emulator.cores import holders

    monkeypatch.setenv("TRNFLOW_RANK_START", start)
    spec = make_spec(train={"steps": 100_000, "checkpoint_every": 100_000})
    job_id = backend.submit(JobRequest(spec, "train", f"start-{start}"))
    deadline = time.monotonic() + 60
    while '"event": "data"' not in backend.logs(job_id)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    group = json.loads((backend.jobs_dir / job_id / "pid.json").read_text())["pid"]
    ranks = [h["pid"] for h in holders(2).values()]
    groups = {os.getpgid(r) for r in ranks}
    with open(f"/proc/{ranks[0]}/cmdline", "rb") as fh:
        command = fh.read().replace(b"\0", b" ").decode()
    backend.cancel(job_id)
    assert len(ranks) == 2
    assert (groups == {group}) == (start == "fork"), (groups, group)
    assert ("-m trnflow.workload train" in command) == (start == "exec"), command


def test_unknown_job_is_a_clear_error(backend):
    with pytest.raises(KeyError, match="no local job"):
        backend.describe("nope")


def test_a_rank_killed_without_a_word_is_a_lost_worker_and_retryable(backend, make_spec):
    import signal

    from trnflow.emulator.cores import holders

    spec = make_spec(name="lostrank", train={"steps": 100_000, "checkpoint_every": 100_000})
    job_id = backend.submit(JobRequest(spec, "train", "t4", cores=(0, 1)))
    deadline = time.monotonic() + 60
    while '"event": "data"' not in backend.logs(job_id)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(holders(2)[1]["pid"], signal.SIGKILL)  # rank 1 dies as the OOM killer would end it
    info = wait(backend, job_id, 0.2)
    assert info.state is JobState.FAILED
    assert info.failure.type == "WorkerLost" and info.failure.retryable is True
    # torchrun may stop rank 0 before it notices the broken link: its record tells it from rank 1
    assert info.failure.ranks == [1] and info.failure.signal == "SIGKILL"


def test_run_ids_cannot_leave_the_checkpoint_folder(make_spec):
    from trnflow.flows._stages import StageRunner

    for bad in ("../escape", "a/b", ".."):
        with pytest.raises(ValueError, match="run id"):
            StageRunner(make_spec(), bad)


def test_a_job_whose_submitter_is_killed_ends_with_it(backend, make_spec, tmp_path):
    """A flow process killed with SIGKILL leaves no job behind holding its cores."""
    import signal
    import subprocess
    import sys

    spec = make_spec(1, train={"steps": 100_000, "checkpoint_every": 100_000})
    (tmp_path / "spec.json").write_text(spec.model_dump_json())
    submitter = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from trnflow.specs import JobSpec\n"
        "from trnflow.backends import JobRequest\n"
        "from trnflow.backends.local import LocalBackend\n"
        "from trnflow.settings import TrnflowSettings\n"
        "spec = JobSpec.model_validate_json(open(sys.argv[1]).read())\n"
        "print(LocalBackend(TrnflowSettings().jobs_dir).submit(JobRequest(spec, 'train', 'orphan')), flush=True)\n"
        "time.sleep(600)\n"), str(tmp_path / "spec.json")], stdout=subprocess.PIPE, text=True)
    job_id = submitter.stdout.readline().strip()
    deadline = time.monotonic() + 60
    while '"event": "data"' not in backend.logs(job_id)[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    pid = json.loads((backend.jobs_dir / job_id / "pid.json").read_text())["pid"]
    submitter.send_signal(signal.SIGKILL)
    submitter.wait()
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the job's supervisor and launcher are gone...
    job_dir = str(backend.jobs_dir / job_id)
    while _processes_of(job_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_of(job_dir) == []  # ...and so are its workers, which torchrun runs in sessions of their own
    info = backend.describe(job_id)
    assert info.state is JobState.FAILED
    assert json.loads((backend.jobs_dir / job_id / "exit.json").read_text())["orphaned"] is True
    assert "is gone; ending the job" in backend.logs(job_id)[0]


def _processes_of(job_dir: str) -> list[int]:
    """The processes whose command line names the job's folder."""
    found = []
    for proc in os.listdir("/proc"):
        try:
            with open(f"/proc/{proc}/cmdline", "rb") as fh:
                if job_dir.encode() in fh.read():
                    found.append(int(proc))
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError, ValueError):
            continue
    return found


def test_on_a_neuron_host_sanity_reads_neuron_ls_and_collectives_run_nccom_test(backend, make_spec, tmp_path,
                                                                                 monkeypatch):
    """With the SDK's tools on PATH the jobs use them (here: executables printing their real formats),
    and say so; a core neuron-ls does not list is a bad core."""
    one_core_listed = {"neuron_device": 0, "bdf": "00:1e.0", "cpu_affinity": "0-7", "numa_node": "0",
                       "connected_to": [], "nc_count": 1, "memory_size": 34359738368, "neuroncore_ids": [0],
                       "neuron_processes": []}
    bin_dir = tmp_path / "bin"
    fake_neuron_ls(bin_dir, [one_core_listed])
    fake_tool(bin_dir, "nccom-test", NCCOM_TEST)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    spec = make_spec()
    sanity = wait(backend, backend.submit(JobRequest(spec, "sanity", "host")), 0.2)
    assert sanity.state is JobState.SUCCEEDED, backend.logs(sanity.job_id)[0]
    assert sanity.result.inventory.model_dump() == {"source": "neuron-ls", "devices": 1, "cores": 1, "missing": [1],
                                                    "held": {}}
    assert sanity.result.bad_cores == [1] and sanity.result.passed is False
    assert sanity.result.collectives is None  # rank 1 never saw the list, yet knew not to sweep
    swept = wait(backend, backend.submit(JobRequest(spec, "collectives", "host")), 0.2)
    assert swept.state is JobState.SUCCEEDED, backend.logs(swept.job_id)[0]
    assert swept.result.source == "nccom-test" and swept.result.ranks == 2
    assert [r.model_dump(exclude_defaults=True) for r in swept.result.rows] == [
        {"op": "all_reduce", "size(B)": 65536, "count(elems)": 16384, "type": "fp32", "time:avg(us)": 61.0,
         "algbw(GB/s)": 1.0, "busbw(GB/s)": 1.0, "correct": True}]
