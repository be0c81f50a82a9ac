"""Scheduled incremental retraining, under a real Prefect API: a failed run changes nothing, a good
one trains from the champion on the new days only and promotes last, a run with nothing new
launches no job, and two runs of the same model never overlap."""

import datetime as dt
import os
import shutil

import pytest

from tests.factories import commit
from trnflow.flows._lock import model_lock
from trnflow.flows._stages import PipelineFailed
from trnflow.flows.incremental_retrain import STAGES, incremental_retrain
from trnflow.lifecycle.digests import registered_digests
from trnflow.lifecycle.registry import Registry
from trnflow.results import RunOutcome
from trnflow.storage import local_path
from trnflow.workload.embeddings import CURRENT, MANIFEST, current, current_url, manifest
from trnflow.workload.synth import synthesize


@pytest.fixture
def retrain_spec(make_spec, tmp_path):
    data = tmp_path / "data"
    synthesize(data, days=2, rows_per_day=300, seed=5, holdout_rows=200, inference_rows=120)

    def make(**sections):
        base = {"data": {"train": str(data / "train"), "holdout": str(data / "holdout"),
                         "inference": str(data / "inference")},
                "train": {"steps": 10, "checkpoint_every": 10, "log_every": 10},
                # retraining on a new day moves the model: this test is about the orchestration
                "gate": {"reference": "champion", "max_abs_diff": 0.2}}
        for name, values in sections.items():
            base[name] = {**base.get(name, {}), **values}
        return make_spec(cores=1, **base)

    return make, data


def _jobs(home) -> int:
    jobs = home / "jobs"
    return len(list(jobs.iterdir())) if jobs.is_dir() else 0


def _run(spec, **kwargs):
    """The flow run's state and outcome: a RunOutcome as JSON, or the exception it ended with."""
    state = incremental_retrain(spec, return_state=True, **kwargs)
    outcome = state.result(raise_on_failure=False)
    return state, outcome.model_dump(mode="json") if isinstance(outcome, RunOutcome) else outcome


@pytest.mark.slow
def test_retraining_changes_the_champion_only_when_a_whole_run_succeeds(prefect_api, retrain_spec, trnflow_home,
                                                                        monkeypatch):
    make, data = retrain_spec
    spec = make()
    registry = Registry(spec.registry_url)

    # a run that fails after its gate (the inference data is missing) promotes nothing
    broken = make(data={"inference": str(data / "no-such-folder")})
    state, outcome = _run(broken)
    assert state.is_failed() and isinstance(outcome, PipelineFailed) and outcome.stage == "infer"
    assert [r.stage for r in outcome.stages] == ["sanity", "collectives", "compile", "train", "evaluate", "infer"]
    assert registry.champion(spec.name) is None
    assert [v.entry.status for v in registry.versions(spec.name)] == ["passed"]  # gated, never promoted
    published = local_path(spec.inference.output_url)
    assert current(str(published)) is None

    # the next run retries the same window, and promotes as its last step
    state, outcome = _run(spec)
    assert state.is_completed(), outcome
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
    first = registry.champion(spec.name)
    assert first.version == 2 and first.watermark == "2026-01-02"
    assert outcome["results"]["train"]["partitions"] == ["2026-01-01", "2026-01-02"]
    assert outcome["results"]["evaluate"]["against"] == "no champion"
    assert manifest(current_url(str(published)))["checkpoint"] == first.checkpoint  # the champion's, published
    assert current(str(published))["version"] == 2 and (published / "v000002" / MANIFEST).is_file()
    assert outcome["results"]["promote"]["summary"].endswith("; 120 rows published")

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).name == (
            "quickstart: dt=2026-01-01..2026-01-02 from scratch")

    # nothing new since the champion's watermark: Completed, and no job launched; but a publication
    # of the champion's outputs that was cut short (promoted, `current` not moved yet) is finished first
    (published / CURRENT).unlink()
    launched = _jobs(trnflow_home)
    state, outcome = _run(spec)
    assert state.is_completed() and outcome["nothing_new"]
    assert current(str(published))["version"] == 2
    assert state.message == f"nothing new: {spec.data.train} has no partitions after 2026-01-02"
    assert _jobs(trnflow_home) == launched

    # a new day is being written; with data.ready_marker, it waits until it is marked complete
    shutil.copytree(data / "train" / "dt=2026-01-02", data / "train" / "dt=2026-01-03")
    spec = make(data={"ready_marker": "_SUCCESS"})
    state, outcome = _run(spec)
    assert state.is_completed() and outcome["nothing_new"] and _jobs(trnflow_home) == launched
    assert state.message.endswith("has no partitions marked ready by _SUCCESS after 2026-01-02")
    (data / "train" / "dt=2026-01-03" / "_SUCCESS").write_text("")

    # the day is complete, but another retraining of the model holds its lock: this run is refused
    with model_lock(spec.name, timeout_seconds=10):
        state, outcome = _run(spec, lock_timeout_seconds=1)
    assert state.is_failed() and "was refused" in str(outcome)
    assert _jobs(trnflow_home) == launched and registry.champion(spec.name).version == 2

    # with the lock free, it trains from the champion on the new day only, and gates against it; the
    # run is named after what it trained on (here the flow's own listing is made to see one day too many)
    import trnflow.flows.incremental_retrain

    monkeypatch.setattr(trnflow.flows.incremental_retrain, "new_partitions", lambda *_: ["2026-01-02", "2026-01-03"])
    state, outcome = _run(spec)
    assert state.is_completed(), outcome
    results = outcome["results"]
    assert results["train"]["partitions"] == ["2026-01-03"] and results["train"]["parent"] == first.checkpoint
    with get_client(sync_client=True) as client:
        renamed = client.read_flow_run(state.state_details.flow_run_id).name
    assert renamed == "quickstart: dt=2026-01-03 from champion v2"
    assert results["evaluate"]["against"] == "champion v2"
    assert results["evaluate"]["verdict"]["mode"] == "no-regression"
    change = results["evaluate"]["verdict"]["points"][-1]["diff"]
    assert results["evaluate"]["summary"].endswith(f"{change:+.4f} vs champion v2 (allowed regression ±0.2): passed")
    second = registry.champion(spec.name)
    assert second.version == 3 and second.watermark == "2026-01-03"
    assert manifest(current_url(str(published)))["checkpoint"] == second.checkpoint
    assert manifest(str(published / "v000002"))["checkpoint"] == first.checkpoint  # kept for a rollback
    assert second.entry.parent_version == 2
    assert results["promote"]["summary"] == "champion v3 (was v2), data up to 2026-01-03; 120 rows published"
    assert dt.date.fromisoformat(second.watermark) > dt.date.fromisoformat(first.watermark)


def test_a_lost_lease_is_noticed_and_stops_promotion(prefect_api, monkeypatch):
    """The server forgets the run's lease (it expired, or a server keeping leases in memory
    restarted): the renewal notices, another run can take the slot, and `check` refuses to go on."""
    import time

    from prefect.client.orchestration import get_client

    from trnflow.errors import FatalError
    from trnflow.flows import _lock

    monkeypatch.setattr(_lock, "RENEW_EVERY_SECONDS", 0.2)
    with model_lock("leased", timeout_seconds=10) as held:
        held.check()  # renewed, still ours
        time.sleep(0.5)
        held.check()
        with get_client(sync_client=True) as client:
            client.release_concurrency_slots_with_lease(held.lease_id)  # what an expiry does
        deadline = time.monotonic() + 10
        while held.lost is None and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(FatalError, match=r"lost its hold on trnflow-model-leased.*stops before promoting"):
            held.check()
        with model_lock("leased", timeout_seconds=1) as other:  # the slot is free for another run
            other.check()
            other._stop.set()  # its renewals stop (a server that does not answer) ...
            other._thread.join()
            other._expires = time.monotonic() + _lock.MARGIN_SECONDS - 1  # ... until the lease nearly runs out
            with pytest.raises(FatalError, match="last renewed over"):
                other.check()


def test_a_day_in_another_format_fails_the_training_job_naming_it(prefect_api, retrain_spec, trnflow_home):
    """A day written as CSV in a JSONL dataset is not passed over (which would let the watermark move
    past a day never trained on): retraining refuses it before launching a job, the training job of
    a pipeline run fails with a DataError naming the day and its files and is not retried, and the
    registry is left as it was."""
    import csv
    import json

    from trnflow.errors import DataError

    make, data = retrain_spec
    day = data / "train" / "dt=2026-01-02"
    rows = [json.loads(line) for line in (day / "part-00000.jsonl").read_text().splitlines()]
    with (day / "part-00000.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (day / "part-00000.jsonl").unlink()
    spec = make()

    def train_jobs() -> int:
        return len(list((trnflow_home / "jobs").glob("*-train-*")))

    expected = ("day dt=2026-01-02 (dt=2026-01-02/part-00000.csv) holds no jsonl files (data.format), only .csv "
                "files; write the day as jsonl, or remove its folder")
    before = train_jobs()
    # retraining finds it in the listing, before it launches any job
    state, outcome = _run(spec)
    assert state.is_failed() and isinstance(outcome, DataError), outcome
    assert expected in " ".join(str(outcome).split())
    assert train_jobs() == before
    # a run that reads every day finds it in the training job, which fails naming it
    from trnflow.flows.pipeline import pipeline

    state = pipeline(spec, return_state=True)
    outcome = state.result(raise_on_failure=False)
    assert state.is_failed() and isinstance(outcome, PipelineFailed) and outcome.stage == "train", outcome
    assert isinstance(outcome.cause, DataError)
    assert expected in " ".join(str(outcome.cause).split())
    assert train_jobs() == before + 1  # a DataError is never retried
    registry = Registry(spec.registry_url)
    assert registry.champion(spec.name) is None and registry.versions(spec.name) == []


def test_the_champion_and_its_published_outputs_change_together(make_spec, prefect_api, tmp_path):
    """Item 18: `current` cannot be moved (here it is a folder, which not even root can overwrite
    with a file): the promotion is rolled back, so the champion is still the one `current` names."""
    import json

    from prefect import flow

    from trnflow.errors import FatalError
    from trnflow.tasks.promote import promote_champion

    spec = make_spec(cores=1, name="together")
    out = local_path(spec.inference.output_url)
    registry = Registry(spec.registry_url)
    for version in (1, 2):
        folder = out / f"v{version:06d}"
        folder.mkdir(parents=True)
        checkpoint = tmp_path / "c" / str(version)
        checkpoint.mkdir(parents=True)
        (checkpoint / "model.pt").write_bytes(f"weights {version}".encode())
        commit(checkpoint)
        (folder / MANIFEST).write_text(json.dumps({"rows": 3, "shards": [], "checkpoint": checkpoint.as_uri()}))
        registry.register(spec.name, {"checkpoint": checkpoint.as_uri(), "output_url": spec.inference.output_url,
                                      "digests": registered_digests(checkpoint.as_uri(), None)})
    registry.promote(spec.name, 1)
    (out / CURRENT).mkdir()

    @flow
    def promote_two():
        return promote_champion(spec, "run-2", 2, registry.generation(spec.name))

    state = promote_two(return_state=True)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, FatalError) and "v2's outputs could not be published" in str(error)
    assert "the champion is v1" in str(error)
    assert registry.champion(spec.name).version == 1
    assert [(h.action, h.version) for h in registry.history(spec.name)] == [
        ("promote", 1), ("promote", 2), ("rollback", 1)]


def test_a_slot_left_by_a_killed_run_on_this_host_is_freed_for_the_next(prefect_api):
    """Item 17: a run holding the model's slot is SIGKILLed (out of memory, say) and never gives it
    back; the next run of the model sees that its holder's process is gone and takes the slot at
    once, rather than waiting for a lease a restarted local API has forgotten."""
    import signal
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    from trnflow.flows._lock import holder, model_lock

    code = ("from trnflow.flows._lock import model_lock\nimport time\n"
            "with model_lock('crashy', 10, 'run doomed-1'):\n    print('held', flush=True)\n    time.sleep(600)\n")
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    doomed = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert doomed.stdout.readline().strip() == "held"
        assert holder("crashy") == "run doomed-1"
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
    with model_lock("crashy", timeout_seconds=5, who="run next-2"):
        assert holder("crashy") == "run next-2"
    assert holder("crashy") is None
