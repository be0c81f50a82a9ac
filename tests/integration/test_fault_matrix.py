"""The fault matrix's CI cases: one run hit by three faults, one on AWS Batch without capacity for its
first instance type, and two sharded runs (a rank torn while writing its shard; a hardware error
that leaves fewer cores), each compared with the fault-free run of its strategy. `make faults` runs every case of the
matrix (tests/faults)."""

import pytest

from tests.faults.matrix import CASES, Matrix, passed
from tests.faults.outcome import steps_redone
from tests.faults.world import world


@pytest.mark.slow
def test_the_ci_cases_of_the_fault_matrix_end_like_their_fault_free_runs(
        prefect_api, tmp_path, compile_cache):
    cases = {c.name: c for c in CASES if c.ci}
    assert set(cases) == {"kill-torn-hw", "batch-no-capacity", "fsdp-torn-checkpoint",
                          "fsdp-hardware-error-fewer-cores"}
    with world(tmp_path, reference=False, prefect=False, compile_cache=compile_cache) as w, Matrix(w) as matrix:
        matrix.run_baseline()
        row = matrix.run_case(cases["kill-torn-hw"])
        starved = matrix.run_case(cases["batch-no-capacity"])
        torn = matrix.run_case(cases["fsdp-torn-checkpoint"])
        fewer = matrix.run_case(cases["fsdp-hardware-error-fewer-cores"])
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
    # sharded: rank 1's shard of the step-20 checkpoint half written; the retry resumes from step 10, bitwise
    assert passed(torn), torn.get("error") or torn
    assert torn["retries_by"] == {"task:train": 1} and torn["steps_redone"] == 10
    # sharded on two cores, core 1 fails at step 25: the retry reshards the step-20 checkpoint onto core 0
    # alone, and the model computes what the fault-free run's does (metrics and embeddings within 1e-6)
    assert passed(fewer), fewer.get("error") or fewer
    assert fewer["train_cores"] == [0] and fewer["steps_redone"] == 4


def test_steps_redone_are_counted_across_attempts_and_jobs():
    def log(*events):
        return "\n".join(f'{{"event": "{e}", "step": {s}}}' for e, s in events)

    first = log(*[("train", s) for s in range(1, 15)])
    resumed = log(("data", 0), ("resume", 10), *[("train", s) for s in range(11, 41)])
    assert steps_redone([first, resumed], 40) == (4, 2)
    assert steps_redone([first + "\n" + resumed], 40) == (4, 2)  # one cloud job, two attempts
    restarted = log(*[("train", s) for s in range(1, 41)])  # no checkpoint to resume from
    assert steps_redone([first, restarted], 40) == (14, 2)
