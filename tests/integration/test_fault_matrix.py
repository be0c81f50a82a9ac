"""The fault matrix's CI cases: one run hit by three faults, one on AWS Batch without capacity for its
first instance type, and two sharded runs (a rank torn while writing its shard; a hardware error
that leaves fewer cores; in test_fault_matrix_sharded.py, so that the two test processes share the
cases), each compared with the fault-free run of its layout (`fault_free`: made once for the whole
pytest run, in a world of its own with the same data and spec). `make faults` runs every case of
the matrix (tests/faults)."""

import dataclasses

import pytest
import torch

from tests.faults.matrix import CASES, Matrix, passed
from tests.faults.outcome import Snapshot, steps_redone
from tests.faults.world import world

CI_CASES = {c.name: c for c in CASES if c.ci}


def _kill_torn_hw(row):
    # the train task retried each fault once; the hardware error moved the run off core 0
    assert row["retries_by"] == {"task:train": 3} and row["training_attempts"] == 4
    assert 0 not in row["train_cores"]
    # steps 11-12 (rank 0 waits in step 13's all-reduce), 11-20 for the torn step-20 checkpoint, 21-24
    assert row["steps_redone"] == 16
    # final weights and optimizer state, registry, embeddings and checkpoints as without faults
    assert row["weights"] and row["registry"] and row["outputs"] and row["checkpoints"]


def _batch_no_capacity(row):
    # no trn1.32xlarge: every stage ran on trn1n.32xlarge, the spec's next preference, and ended as without faults
    assert row["train_instance"] == "trn1n.32xlarge" and row["steps_redone"] == 0


def _fsdp_torn_checkpoint(row):
    # sharded: rank 1's shard of the step-20 checkpoint half written; the retry resumes from step 10, bitwise
    assert row["retries_by"] == {"task:train": 1} and row["steps_redone"] == 10


def _fsdp_fewer_cores(row):
    # sharded on two cores, core 1 fails at step 25: the retry reshards the step-20 checkpoint onto core 0
    # alone, and the model computes what the fault-free run's does (metrics and embeddings within 1e-6)
    assert row["train_cores"] == [0] and row["steps_redone"] == 4


EXPECTED = {"kill-torn-hw": _kill_torn_hw, "batch-no-capacity": _batch_no_capacity,
            "fsdp-torn-checkpoint": _fsdp_torn_checkpoint, "fsdp-hardware-error-fewer-cores": _fsdp_fewer_cores}


UNSHARDED = ["kill-torn-hw", "batch-no-capacity"]
SHARDED = ["fsdp-torn-checkpoint", "fsdp-hardware-error-fewer-cores"]
"""The CI cases run here, and in test_fault_matrix_sharded.py."""


def test_every_ci_case_is_run_and_checked_once():
    assert set(CI_CASES) == set(EXPECTED) == set(UNSHARDED) | set(SHARDED)
    assert not set(UNSHARDED) & set(SHARDED)


def run_ci_case(name, fault_free, tmp_path, compile_cache):
    """The CI case `name` in a world of its own, compared with the fault-free run of its layout."""
    case = CI_CASES[name]
    with world(tmp_path, reference=False, prefect=False, compile_cache=compile_cache) as w, Matrix(w) as matrix:
        matrix.load_baseline(fault_free(case.baseline), case.baseline)
        row = matrix.run_case(case)
    assert passed(row), row.get("error") or "; ".join(f"{key} {row.get(key)!r}" for key in (  # each check, whole
        "recovered", "training_attempts", "retries_by", "steps_redone", "max_redone", "fault_seen", "weights",
        "registry", "outputs", "checkpoints", "nothing_lost") if key in row)
    EXPECTED[name](row)


@pytest.mark.slow
@pytest.mark.parametrize("name", UNSHARDED)
def test_a_ci_case_of_the_fault_matrix_ends_like_its_fault_free_run(name, fault_free, prefect_api, tmp_path,
                                                                     warm_compile_cache):
    run_ci_case(name, fault_free, tmp_path, warm_compile_cache)


def test_a_case_differs_from_its_baseline_by_one_bit_of_one_weight():
    """What the cases are compared with is held to the bit: the fault-free run's weights with one bit
    of one value flipped no longer equal the run's, and the other parts still do."""
    weights = {"w": torch.linspace(-1, 1, 8), "b": torch.zeros(2)}
    base = Snapshot(weights, {"state": {0: {"exp_avg": torch.ones(3)}}}, {"champion": None}, {"r1": [0.5, 0.25]},
                    [10, 20], [{"step": 20, "loss": 0.5}])
    assert base.differences(dataclasses.replace(base)) == {"weights": True, "registry": True, "outputs": True,
                                                           "checkpoints": True}
    flipped = weights["w"].clone()
    flipped.view(torch.int32)[3] ^= 1
    mutated = dataclasses.replace(base, model={**weights, "w": flipped})
    assert mutated.differences(base) == {"weights": False, "registry": True, "outputs": True, "checkpoints": True}


def test_steps_redone_are_counted_across_attempts_and_jobs():
    def log(*events):
        return "\n".join(f'{{"event": "{e}", "step": {s}}}' for e, s in events)

    first = log(*[("train", s) for s in range(1, 15)])
    resumed = log(("data", 0), ("resume", 10), *[("train", s) for s in range(11, 41)])
    assert steps_redone([first, resumed], 40) == (4, 2)
    assert steps_redone([first + "\n" + resumed], 40) == (4, 2)  # one cloud job, two attempts
    restarted = log(*[("train", s) for s in range(1, 41)])  # no checkpoint to resume from
    assert steps_redone([first, restarted], 40) == (14, 2)
