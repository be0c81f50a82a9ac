"""Injected faults are found, the bad core is named, and preflight can go on without it."""

import json
import os
import socket
import subprocess
import sys

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from tests.integration.test_pipeline import _artifacts, _logs
from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.cli import render
from trnflow.cli.app import app
from trnflow.emulator.faults import parse
from trnflow.errors import FatalError
from trnflow.flows._stages import PipelineFailed
from trnflow.neuron.nccom import bus_factor
from trnflow.results import CollectivesResult, FailureReport, RunOutcome, SanityResult
from trnflow.settings import TrnflowSettings
from trnflow.testing.mockcloud.nodes import free_port
from trnflow.workload.memory import decided


@pytest.fixture
def backend(trnflow_home) -> LocalBackend:
    return LocalBackend(TrnflowSettings().jobs_dir)


def _failed_engines(result, core: int) -> set[str]:
    record = next(c for c in result.per_core if c.core == core)
    return {name.split("/")[0] for name in record.failed}


def test_a_corrupting_core_fails_its_engine_tests_and_is_named(backend, make_spec):
    spec = make_spec(faults=[{"kind": "corrupt", "core": 1}], compute={"precision": "bf16"})
    info = wait(backend, backend.submit(JobRequest(spec, "sanity", "f")), 0.2)
    assert info.state is JobState.SUCCEEDED
    assert info.result.bad_cores == [1]
    assert _failed_engines(info.result, 1) == {"tensor", "vector", "scalar", "gpsimd"}
    assert _failed_engines(info.result, 0) == set()


def test_a_core_with_bad_memory_fails_only_the_memory_test(backend, make_spec, monkeypatch):
    monkeypatch.setenv("TRNFLOW_FAULTS", "memory@0")
    info = wait(backend, backend.submit(JobRequest(make_spec(), "sanity", "f")), 0.2)
    assert info.result.bad_cores == [0]
    assert _failed_engines(info.result, 0) == {"memory"}


def test_a_hung_collective_is_cut_off_by_the_timeout_and_the_core_named(backend, monkeypatch):
    monkeypatch.setenv("TRNFLOW_FAULTS", "hang@3")
    request = JobRequest(None, "collectives", "hang", processes=2, cores=(2, 3),
                         options={"maxbytes": 65536, "timeout_seconds": 5})
    info = wait(backend, backend.submit(request), 0.2)
    assert info.state is JobState.FAILED
    assert info.failure.type == "CollectiveTimeout" and info.failure.retryable is True
    assert "core 3 (rank 1) never reached it" in info.failure.message
    assert "Timed out" in info.failure.message


def test_a_hang_on_a_lone_core_is_reported_at_once(backend, make_spec):
    spec = make_spec(compute={"cores_per_node": 1}, train={"global_batch_size": 32},
                     faults=[{"kind": "hang", "core": 0}])
    info = wait(backend, backend.submit(JobRequest(spec, "sanity", "lone")), 0.2)
    assert info.state is JobState.FAILED
    assert info.failure.type == "CollectiveTimeout" and info.failure.bad_cores == [0]


def test_a_corrupting_core_makes_collectives_wrong_and_is_named(backend, monkeypatch):
    monkeypatch.setenv("TRNFLOW_FAULTS", "corrupt@1")
    request = JobRequest(None, "collectives", "c", processes=2, options={"maxbytes": 65536, "check": True})
    info = wait(backend, backend.submit(request), 0.2)
    assert info.state is JobState.FAILED
    assert info.failure.type == "CorruptCollective"
    assert "core(s) [1] sent corrupted data" in info.failure.message


def _train_two_ranks(backend, make_spec, name: str, fault: dict):
    spec = make_spec(name=name, train={"steps": 6, "checkpoint_every": 100, "log_every": 1}, faults=[fault])
    job_id = backend.submit(JobRequest(spec, "train", name, cores=(0, 1)))
    info = wait(backend, job_id, 0.2)
    assert info.state is JobState.FAILED, backend.logs(job_id)[0]
    return info, backend.jobs_dir / job_id


def test_a_rank_killed_by_a_signal_is_named_alone_with_its_signal_and_its_log(backend, make_spec):
    """Rank 1 is SIGKILLed; rank 0 then loses its peer, or is stopped by torchrun: only rank 1 is named."""
    info, job_dir = _train_two_ranks(backend, make_spec, "sigkilled", {"kind": "kill", "core": 1, "step": 3})
    failure = info.failure
    assert failure.type == "WorkerLost" and failure.retryable is True
    assert failure.ranks == [1] and (failure.exitcode, failure.signal) == (-9, "SIGKILL")
    message = failure.message
    assert message.startswith("rank 1 exited without reporting why (signal SIGKILL")
    assert "rank 1 failed first (signal SIGKILL); the last lines of its log (" in message
    assert f"{job_dir / 'ranks'}" in message and "/attempt_0/1)" in message  # its own log's folder
    assert "rank 0" not in message and "rank(s)" not in message and "Connection reset" not in message


def test_a_container_node_names_its_killed_rank_with_its_signal(make_spec, tmp_path):
    """A Batch node (`python -m trnflow.backends.container batch`) whose rank 1 is SIGKILLed: the node's
    failure names rank 1 and the signal, and the ranks' lines are in the container's own output."""
    spec = make_spec(train={"steps": 6, "checkpoint_every": 100, "log_every": 1},
                     faults=[{"kind": "kill", "core": 1, "step": 3}])
    (tmp_path / "spec.json").write_text(decided(spec).model_dump_json())  # as the backend hands it to the job
    port = free_port()
    env = {**os.environ, "AWS_BATCH_JOB_ID": "job-1#0", "AWS_BATCH_JOB_NUM_NODES": "1",
           "AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0", "TRNFLOW_MASTER_PORT": str(port),
           "TRNFLOW_OUTPUT_DIR": str(tmp_path / "node" / "output"),
           "TRNFLOW_SPEC_URL": (tmp_path / "spec.json").as_uri(),
           "TRNFLOW_RESULT_URL": (tmp_path / "results").as_uri(), "TRNFLOW_PHASE": "train",
           "TRNFLOW_RUN_ID": "killed", "TRNFLOW_NPROC_PER_NODE": "2"}
    node = subprocess.run([sys.executable, "-m", "trnflow.backends.container", "batch"], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert node.returncode == 75, node.stdout[-2000:] + node.stderr[-2000:]  # transient: Batch retries it
    failure = FailureReport.model_validate_json((tmp_path / "results" / "job-1" / "failure-node0.json").read_text())
    assert failure.type == "WorkerLost" and failure.ranks == [1]
    assert (failure.exitcode, failure.signal) == (-9, "SIGKILL")
    assert failure.message.startswith("rank 1 exited without reporting why (signal SIGKILL")
    assert '"event": "train"' in node.stdout  # the ranks wrote to the container's log stream
    ranks = tmp_path / "node" / "trnflow-ranks"  # beside the output (which SageMaker uploads), not in it
    assert (ranks / "exits.json").is_file()
    assert list(ranks.glob("*/attempt_0/1")) and not list(ranks.glob("*/attempt_0/1/std*.log"))  # torchrun's own


def test_a_rank_that_fails_is_named_with_its_exit_code_and_the_last_lines_of_its_own_log(backend, make_spec):
    info, job_dir = _train_two_ranks(backend, make_spec, "hwfail", {"kind": "hw", "core": 1, "step": 3})
    failure = info.failure
    assert failure.type == "HardwareError" and failure.bad_cores == [1] and failure.exitcode == 1
    message = failure.message
    assert message.startswith("NeuronCore 1: uncorrectable hardware error at step 3")
    _, _, tail = message.partition("\nrank 1 failed first (exit code 1); the last lines of its log (")
    assert tail, message
    assert "trnflow.workload train failed on rank 1: HardwareError" in tail  # what rank 1 itself wrote last
    assert '"rank": 0' not in tail and "rank 0" not in message  # nothing of rank 0's log
    rank_log = next((job_dir / "ranks").glob("*/attempt_0/1/stderr.log")).read_text()
    assert "failed on rank 1: HardwareError" in rank_log
    assert "failed on rank 1: HardwareError" in backend.logs(job_dir.name)[0]  # job.log still has every line


def test_a_rank_that_stalls_with_no_peer_to_notice_is_ended_by_its_watchdog_and_the_retry_resumes(
        backend, make_spec):
    """A lone rank stops making progress at step 3 (a host that stopped answering): nothing else would
    end it before the attempt's timeout. Its watchdog ends it as Stalled, naming the rank, core and
    host and what it did last; the failure is transient, and the same run then resumes and ends."""
    spec = make_spec(name="stalled", compute={"cores_per_node": 1, "hang_timeout_minutes": 0.4},
                     preflight={"collective_timeout_seconds": 10},
                     train={"steps": 6, "checkpoint_every": 2, "log_every": 1},
                     faults=[{"kind": "stall", "core": 0, "step": 3}])
    job_id = backend.submit(JobRequest(spec, "train", "stalled", cores=(0,)))
    info = wait(backend, job_id, 0.2)
    assert info.state is JobState.FAILED, backend.logs(job_id)[0]
    failure = info.failure
    assert failure.type == "Stalled" and failure.retryable is True and failure.rank == 0
    assert failure.message.startswith(f"rank 0 (NeuronCore 0) on {socket.gethostname()} made no progress for ")
    assert "its last progress was: checkpointing step 2, done" in failure.message  # written after step 2
    again = wait(backend, backend.submit(JobRequest(spec, "train", "stalled", cores=(0,))), 0.2)
    assert again.state is JobState.SUCCEEDED, again.failed()
    assert again.result.resumed_from and again.result.start_step == 2


def test_a_host_that_stops_mid_run_is_named_by_its_peer_within_a_few_median_steps_and_a_slow_one_named(
        backend, make_spec):
    """Rank 1's core is slow (each step's own work takes it three times as long), and its process stops
    whole at step 8 of two ranks (a host that stopped answering: its own watchdog stops too). The
    limits of old (the collective timeout, the hang timeout) are minutes away: rank 0, waiting in
    step 8, is ended once it made no progress for 3 of its median steps plus the 3 s floor, as
    Stalled, and names rank 1, which never began step 8. The retry resumes from step 4's checkpoint,
    written in the background, and names rank 1 as slow (compute.slow_rank_factor 1.5)."""
    spec = make_spec(name="paced", compute={"hang_timeout_minutes": 10, "hang_floor_seconds": 3},
                     preflight={"collective_timeout_seconds": 300},
                     train={"steps": 10, "checkpoint_every": 4, "log_every": 1},
                     faults=[{"kind": "freeze", "core": 1, "step": 8}, {"kind": "slow", "core": 1}])
    job_id = backend.submit(JobRequest(spec, "train", "paced", cores=(0, 1)))
    info = wait(backend, job_id, 0.2)
    assert info.state is JobState.FAILED, backend.logs(job_id)[0]
    failure = info.failure
    host = socket.gethostname()
    assert failure.type == "Stalled" and failure.retryable is True and failure.rank == 0, failure
    assert failure.ranks == [1]
    assert failure.message.startswith(f"rank 0 (NeuronCore 0) on {host} waited ")
    assert "in training step 8 (3 x its median step of " in failure.message
    assert "compute.hang_step_factor, compute.hang_floor_seconds" in failure.message
    assert f"for rank 1 (NeuronCore 1) on {host}, which last began step 7;" in failure.message
    retry = backend.submit(JobRequest(spec, "train", "paced", cores=(0, 1)))
    again = wait(backend, retry, 0.2)
    assert again.state is JobState.SUCCEEDED, again.failed()
    assert again.result.resumed_from and again.result.start_step == 4
    [slow] = again.result.slow_ranks  # rank 0 is not named
    assert (slow.rank, slow.core, slow.host) == (1, 1, host) and slow.ratio > 1.5 and 6 <= slow.step <= 10
    said = [json.loads(line) for line in backend.logs(retry)[0].splitlines() if '"event": "slow_rank"' in line]
    assert said and {e["slow_rank"] for e in said} == {1} and said[0]["message"].startswith(
        f"rank 1 (nc1 on {host}): ")


def test_fault_syntax_errors_are_clear():
    assert [(f.kind, f.core) for f in parse("corrupt@1, hang@3")] == [("corrupt", 1), ("hang", 3)]
    with pytest.raises(FatalError, match="kind@core"):
        parse("explode@1")


def _preflight(spec):
    from trnflow.flows.preflight import preflight

    state = preflight(spec, return_state=True)
    outcome = state.result(raise_on_failure=False)
    return state, outcome.model_dump(mode="json") if isinstance(outcome, RunOutcome) else outcome


def test_preflight_names_the_bad_core_and_stops(prefect_api, make_spec):
    spec = make_spec(name="badcore", compute={"instance_type": "trn1.32xlarge"},
                     faults=[{"kind": "corrupt", "core": 1}])
    state, outcome = _preflight(spec)
    assert state.is_failed() and isinstance(outcome, PipelineFailed)
    assert outcome.stage == "sanity"
    assert "NeuronCore(s) [1] failed known-answer tests" in str(outcome.cause)
    # the reason where a user looks: the run's state message, in one line, and its summary
    assert state.message.startswith("sanity failed: NeuronCore(s) [1] failed known-answer tests")
    assert "exclude_bad_cores" in state.message and "\n" not in state.message
    summary = _artifacts(state.state_details.flow_run_id)["badcore-summary"].data
    assert summary.splitlines()[0].endswith(state.message)
    assert "- **collectives**, *NotRun*: not run: sanity failed\n" in summary
    assert not any("Traceback" in line for line in _logs(state.state_details.flow_run_id))


def test_a_hung_core_is_named_by_preflight_and_can_be_excluded(prefect_api, make_spec):
    hang = {"compute": {"instance_type": "trn1.32xlarge"}, "faults": [{"kind": "hang", "core": 1}],
            "retries": {"max_retries": 0}}
    spec = make_spec(name="hung", preflight={"collective_timeout_seconds": 5}, **hang)
    state, outcome = _preflight(spec)
    assert state.is_failed() and outcome.stage == "sanity"
    assert "core 1 (rank 1) never reached it" in str(outcome.cause)
    assert outcome.cause.bad_cores == [1]

    spec = make_spec(name="hungx", preflight={"collective_timeout_seconds": 5, "exclude_bad_cores": True}, **hang)
    state, outcome = _preflight(spec)
    assert state.is_completed(), outcome
    assert outcome["results"]["sanity"]["excluded_cores"] == [1]
    assert outcome["results"]["collectives"]["cores"] == [2, 3]


def test_exclusion_needs_enough_healthy_cores(prefect_api, make_spec):
    spec = make_spec(name="toofew", faults=[{"kind": "corrupt", "core": 1}], preflight={"exclude_bad_cores": True})
    state, outcome = _preflight(spec)
    assert state.is_failed()
    assert "only 1 healthy NeuronCore(s) left" in str(outcome.cause)


def test_collectives_command_sweeps_every_op_with_nccom_busbw(trnflow_home):
    result = CliRunner().invoke(app, ["collectives", "--cores", "4", "--op", "all", "--check", "-e", "256KB",
                                      "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    rows = report["results"]
    assert {r["op"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert all(r["correct"] for r in rows)
    for r in rows:
        assert r["busbw(GB/s)"] == pytest.approx(r["algbw(GB/s)"] * bus_factor(r["op"], 4), abs=2e-4)
    assert len(report["cores"]) == 4
    steps = {(p["op"], p["algorithm"]): p["steps"] for p in report["plans"]}  # all_to_all has no plan
    assert steps == {("all_reduce", "ring"): 2 * (4 - 1), ("all_reduce", "tree"): 2 * 2, ("all_gather", "ring"): 3,
                     ("all_gather", "tree"): 2, ("reduce_scatter", "ring"): 3, ("reduce_scatter", "tree"): 2}
    table = CliRunner().invoke(app, ["collectives", "--cores", "4", "--op", "all", "--check", "-e", "64KB"])
    assert table.exit_code == 0, table.output
    assert "Avg bus bandwidth:" in table.stdout and "busbw(GB/s)" in table.stdout
    assert table.stdout.count(" ok") == 4 and "WRONG" not in table.stdout


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The real `trnflow` command in its own process, talking to the session's Prefect API."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run([sys.executable, "-m", "trnflow.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_preflight_command_reports_every_core_and_link(prefect_api, make_spec, tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(yaml.safe_dump(make_spec(name="preflightok").model_dump(mode="json")))
    result = _cli("preflight", str(path), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [s["stage"] for s in report["stages"]] == ["sanity", "collectives"]
    assert report["results"]["sanity"]["memory"]["fits"] is True
    assert [c["core"] for c in report["results"]["sanity"]["per_core"]] == [0, 1]
    rendered = Console(width=200, record=True)
    rendered.print(render.sanity_table(SanityResult.model_validate(report["results"]["sanity"]).per_core))
    text = rendered.export_text()
    assert "nc0" in text and "nc1" in text and "FAIL" not in text
    swept, preflight = CollectivesResult.model_validate(report["results"]["collectives"]), make_spec().preflight
    assert "Avg bus bandwidth" in render.nccom_text(swept.rows)

    # the thresholds the collectives stage enforces, on this real sweep
    from trnflow.tasks.collectives import check_thresholds

    busbw, latency = check_thresholds(preflight, swept)
    assert busbw == swept.avg_busbw_by_op["all_reduce"] and latency > 0
    with pytest.raises(FatalError, match=r"below preflight\.min_busbw_gbps"):
        check_thresholds(preflight.model_copy(update={"min_busbw_gbps": busbw * 2}), swept)
    with pytest.raises(FatalError, match=r"above preflight\.max_latency_us"):
        check_thresholds(preflight.model_copy(update={"max_latency_us": latency / 2}), swept)
