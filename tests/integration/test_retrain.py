"""Scheduled incremental retraining, under a real Prefect API: a failed run changes nothing, a good
one trains from the champion on the new days only and promotes last, a run with nothing new
launches no job, and two runs of the same model never overlap."""

import datetime as dt
import shutil

import pytest

from trnflow.flows._lock import model_lock
from trnflow.flows._stages import PipelineFailed
from trnflow.flows.incremental_retrain import STAGES, incremental_retrain
from trnflow.lifecycle.registry import Registry
from trnflow.results import RunOutcome
from trnflow.storage import local_path
from trnflow.workload.embeddings import MANIFEST, STAGING, manifest
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
        return make_spec(**base)

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
    assert [v.entry["status"] for v in registry.versions(spec.name)] == ["passed"]  # gated, never promoted
    published = local_path(spec.inference.output_url)
    assert manifest(str(published)) is None

    # the next run retries the same window, and promotes as its last step
    state, outcome = _run(spec)
    assert state.is_completed(), outcome
    assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
    first = registry.champion(spec.name)
    assert first.version == 2 and first.watermark == "2026-01-02"
    assert outcome["results"]["train"]["partitions"] == ["2026-01-01", "2026-01-02"]
    assert outcome["results"]["evaluate"]["against"] == "no champion"
    assert manifest(str(published))["checkpoint"] == first.checkpoint  # the champion's embeddings, published
    assert not (published / STAGING).exists()
    assert outcome["results"]["promote"]["summary"].endswith("; 120 embeddings published")

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        assert client.read_flow_run(state.state_details.flow_run_id).name == (
            "quickstart: dt=2026-01-01..2026-01-02 from scratch")

    # nothing new since the champion's watermark: Completed, and no job launched; but a publication
    # of the champion's embeddings that was cut short (staged, manifest gone) is finished first
    staged = published / STAGING / first.entry["run_id"]
    shutil.copytree(published, staged)
    (published / MANIFEST).unlink()
    (published / "part-00000.parquet").unlink()  # the copy had not got that far
    launched = _jobs(trnflow_home)
    state, outcome = _run(spec)
    assert state.is_completed() and outcome["nothing_new"]
    assert manifest(str(published))["checkpoint"] == first.checkpoint and not staged.exists()
    assert (published / "part-00000.parquet").is_file()
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
    assert results["evaluate"]["summary"].endswith(f"{change:+.4f} vs champion v2 (allowed regression 0.2): passed")
    second = registry.champion(spec.name)
    assert second.version == 3 and second.watermark == "2026-01-03"
    assert manifest(str(published))["checkpoint"] == second.checkpoint
    assert second.entry["parent_version"] == 2
    assert results["promote"]["summary"] == "champion v3 (was v2), data up to 2026-01-03; 120 embeddings published"
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
        with pytest.raises(FatalError, match=r"lost its hold on trnflow-retrain-leased.*stops before promoting"):
            held.check()
        with model_lock("leased", timeout_seconds=1) as other:  # the slot is free for another run
            other.check()
            other._stop.set()  # its renewals stop (a server that does not answer) ...
            other._thread.join()
            other._expires = time.monotonic() + _lock.MARGIN_SECONDS - 1  # ... until the lease nearly runs out
            with pytest.raises(FatalError, match="last renewed over"):
                other.check()
