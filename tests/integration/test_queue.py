"""One machine's runs share its cores through its queue: each waits its turn with its reason, none
spends a retry on cores another run holds, and a production run preempts an experiment at a step
boundary, which resumes afterwards to the weights of a run never stopped."""

import threading
import time

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
