"""One machine's runs share its cores through its queue: each waits its turn with its reason, none
spends a retry on cores another run holds, and a production run preempts an experiment at a step
boundary, which resumes afterwards to the weights of a run never stopped."""

import threading
import time

import pytest
import torch

from trnflow.flows.pipeline import pipeline
from trnflow.settings import TrnflowSettings
from trnflow.storage import local_path
from trnflow.workload.checkpoint import load

STEPS = {"steps": 300, "checkpoint_every": 1000, "log_every": 10}


def _states(flow_run_id) -> list:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run_states(flow_run_id)


def _task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def _start(spec, run_id: str, states: dict) -> threading.Thread:
    def go() -> None:
        states[run_id] = pipeline(spec, run_id=run_id, return_state=True)

    thread = threading.Thread(target=go, name=run_id)
    thread.start()
    return thread


def test_three_runs_at_once_wait_their_turn_and_production_preempts_the_experiment_which_resumes_exactly(
        prefect_api, make_spec, warm_compile_cache):
    common = {"gate": {"reference": None}, "registry_url": None, "train": STEPS}
    yielder = make_spec(name="yielder", **common)  # an experiment (the lowest class, unnamed)
    patient = make_spec(name="patient", **common)  # the same training, never stopped
    urgent = make_spec(name="urgent", compute={"priority_class": "production"}, gate={"reference": None},
                       registry_url=None, train={"steps": 20, "checkpoint_every": 20, "log_every": 10})
    states: dict = {}
    threads = [_start(yielder, "yielder-1", states)]
    jobs = TrnflowSettings().jobs_dir
    deadline = time.monotonic() + 600
    while not any('"step": 20,' in p.read_text() for p in jobs.glob("yielder-train-*/job.log")):
        assert time.monotonic() < deadline and threads[0].is_alive(), states
        time.sleep(0.1)
    threads += [_start(urgent, "urgent-1", states), _start(patient, "patient-1", states)]  # both at once
    for thread in threads:
        thread.join(timeout=900)
    assert all(states[r].is_completed() for r in ("yielder-1", "urgent-1", "patient-1")), states

    outcomes = {r: s.result() for r, s in states.items()}
    rows = {r: [(row.stage, row.state) for row in o.stages] for r, o in outcomes.items()}
    # the experiment yielded during training, waited, and trained on from its checkpoint
    assert rows["yielder-1"][3:6] == [("train", "Preempted"), ("queue", "Waited"), ("train", "Completed")]
    train = outcomes["yielder-1"].results["train"]
    stopped = train.start_step
    assert 20 <= stopped < 300 and stopped % 1000  # at a step boundary, not at a scheduled checkpoint
    assert (local_path(yielder.train.checkpoint_url) / "yielder-1" / f"step-{stopped:06d}").is_dir()
    waits = {r: next(row.summary for row in o.stages if row.stage == "queue") for r, o in outcomes.items()}
    assert "run yielder-1 (flow run" in waits["urgent-1"] and "(experiment) yielding to it at a checkpoint" \
        in waits["urgent-1"]
    assert rows["urgent-1"][0] == ("queue", "Waited") and rows["patient-1"][0] == ("queue", "Waited")
    # each waited its turn: the production run, the experiment it stopped, then the one behind them
    ended = {r: max(s.timestamp for s in _states(states[r].state_details.flow_run_id)) for r in states}
    assert ended["urgent-1"] < ended["yielder-1"] < ended["patient-1"]

    for run_id, state in states.items():
        flow_run_id = state.state_details.flow_run_id
        history = [(s.name, s.message or "") for s in _states(flow_run_id)]
        assert any(name in ("Waiting", "Preempted") and message.startswith("waiting: ") for name, message in history)
        counts = [t.run_count for t in _task_runs(flow_run_id)]
        assert counts and set(counts) == {1}, (run_id, counts)  # nobody spent a retry on cores
    assert any(name == "Preempted" and "yielded its cores to run urgent-1" in message
               for name, message in [(s.name, s.message or "") for s in _states(
                   states["yielder-1"].state_details.flow_run_id)])

    # resumed bitwise: the same final weights as the run that was never stopped
    ours = load(outcomes["yielder-1"].results["train"].checkpoint).model
    theirs = load(outcomes["patient-1"].results["train"].checkpoint).model
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # and its cost table bills both of its training jobs, the one it stopped on a row of its own
    billed = {r.stage: r.jobs for r in outcomes["yielder-1"].cost.rows}
    assert billed["train (preempted)"] == 1 and billed["train"] == 1


@pytest.mark.slow
def test_on_two_batch_nodes_a_production_run_preempts_its_teams_experiment_which_resumes_exactly(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """The same on mock Batch, through the stack's queue on the Prefect server: team search may hold 2
    trn1.32xlarge, which its experiment's two-node training holds; its production run asks it to yield,
    Batch stops the job's containers (SIGTERM, a grace, SIGKILL) and both nodes checkpoint at the step
    boundary they agree on; the production run trains, then the experiment resumes on new instances
    to the weights of a job never stopped."""
    import boto3

    from tests.clouds import cloud_spec, in_cloud, upload
    from trnflow.backends import JobRequest, wait
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.service_status import INTERRUPT_REASON
    from trnflow.testing.mockcloud.provision import provision_teams, team_prefixes

    kind = "trn1.32xlarge"
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, compile_cache=warmed_cache) as (cloud, bucket):
        session = provision_teams(cloud.client, ["search"], quotas={kind: 2})["search"]
        for name, value in session.items():  # the orchestrator runs as the team's role
            monkeypatch.setenv(name, value)
        folders = team_prefixes("search")
        s3 = boto3.client("s3")
        upload(s3, dataset, bucket, "quickstart")  # data every team may read
        upload(s3, warmed_cache, bucket, "teams/search/neuron-cache")
        data = {part: f"s3://{bucket}/quickstart/{part}" for part in ("train", "holdout", "inference")}

        def spec(name: str, steps: int, **compute):
            return cloud_spec(make_spec, bucket, "batch", name=name, compute=compute, data=data,
                              compile={"cache_url": folders["cache"]}, registry_url=None, gate={"reference": None},
                              train={"checkpoint_url": folders["checkpoints"], "steps": steps,
                                     "checkpoint_every": 1000, "log_every": 10},
                              inference={"output_url": folders["outputs"]})

        yielder, urgent = spec("yielder", 300), spec("urgent", 20, priority_class="production")
        states: dict = {}
        threads = [_start(yielder, "byielder-1", states)]
        logs = tmp_path / "cloud" / "batch"
        deadline = time.monotonic() + 600
        while not any('"step": 20,' in p.read_text() for p in logs.glob("*/attempt-*/node-0/container.log")):
            assert time.monotonic() < deadline and threads[0].is_alive(), states
            time.sleep(0.2)
        threads.append(_start(urgent, "burgent-1", states))
        for thread in threads:
            thread.join(timeout=900)
        assert all(states[r].is_completed() for r in ("byielder-1", "burgent-1")), states
        outcomes = {r: s.result() for r, s in states.items()}
        rows = [(row.stage, row.state) for row in outcomes["byielder-1"].stages]
        assert ("train", "Preempted") in rows and rows[-1][0] != "queue", rows
        after = rows.index(("train", "Preempted"))
        assert rows[after + 1: after + 3] == [("queue", "Waited"), ("train", "Completed")], rows
        wait_row = next(row.summary for row in outcomes["burgent-1"].stages if row.stage == "queue")
        assert f"team search at its {kind} quota, 2 of 2 instances" in wait_row, wait_row
        assert "(experiment) yielding to it at a checkpoint" in wait_row, wait_row
        stopped = [j for j in boto3.client("batch").describe_jobs(jobs=[
            j["jobId"] for j in boto3.client("batch").list_jobs(jobQueue="trnflow-trn1", jobStatus="FAILED")[
                "jobSummaryList"] if j["jobName"].startswith("yielder-")])["jobs"]]
        assert [j["statusReason"] for j in stopped] == [INTERRUPT_REASON]  # failed, to resume: not cancelled
        train = outcomes["byielder-1"].results["train"]
        assert 20 <= train.start_step < 300 and train.resumed_from

        backend = BatchBackend(cloud_target(TrnflowSettings(), "batch"))
        whole = wait(backend, backend.submit(JobRequest(yielder, "train", "bpatient-1")), 0.5)
        assert whole.state.value == "SUCCEEDED", whole.failure
        ours, theirs = load(train.checkpoint).model, load(whole.result.checkpoint).model
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
