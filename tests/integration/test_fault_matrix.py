"""The fault matrix's CI cases: one run hit by three faults, and one on AWS Batch without capacity for
its first instance type, each compared with the fault-free run. `make faults` runs every case of the
matrix (tests/faults)."""

import pytest

from tests.faults.matrix import CASES, Matrix, passed
from tests.faults.outcome import steps_redone
from tests.faults.world import world


@pytest.mark.slow
def test_a_run_hit_by_three_faults_and_a_batch_run_without_capacity_end_like_the_fault_free_one(
        prefect_api, tmp_path, compile_cache):
    cases = {c.name: c for c in CASES if c.ci}
    assert set(cases) == {"kill-torn-hw", "batch-no-capacity"}
    with world(tmp_path, reference=False, prefect=False, compile_cache=compile_cache) as w, Matrix(w) as matrix:
        matrix.run_baseline()
        row = matrix.run_case(cases["kill-torn-hw"])
        starved = matrix.run_case(cases["batch-no-capacity"])
    # no trn1.32xlarge: every stage ran on trn1n.32xlarge, the spec's next preference, and ended as without faults
    assert passed(starved), starved.get("error") or starved
    assert starved["train_instance"] == "trn1n.32xlarge" and starved["steps_redone"] == 0
    assert passed(row), row
    # the train task retried each fault once; the hardware error moved the run off core 0
    assert row["retries_by"] == {"task:train": 3} and row["training_attempts"] == 4
    assert 0 not in row["train_cores"]
    # steps 11-12 (rank 0 waits in step 13's all-reduce), 11-20 for the torn step-20 checkpoint, 21-24
    assert row["steps_redone"] == 16
    # final weights and optimizer state, registry, embeddings and checkpoints as without faults
    assert row["weights"] and row["registry"] and row["outputs"] and row["checkpoints"]


def test_steps_redone_are_counted_across_attempts_and_jobs():
    def log(*events):
        return "\n".join(f'{{"event": "{e}", "step": {s}}}' for e, s in events)

    first = log(*[("train", s) for s in range(1, 15)])
    resumed = log(("data", 0), ("resume", 10), *[("train", s) for s in range(11, 41)])
    assert steps_redone([first, resumed], 40) == (4, 2)
    assert steps_redone([first + "\n" + resumed], 40) == (4, 2)  # one cloud job, two attempts
    restarted = log(*[("train", s) for s in range(1, 41)])  # no checkpoint to resume from
    assert steps_redone([first, restarted], 40) == (14, 2)
