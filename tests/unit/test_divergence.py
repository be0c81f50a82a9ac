"""The divergence rule (a non-finite loss, or one over `spike_factor` times the recent median), the
rollbacks a run may make, and the skipped steps kept beside its checkpoints."""

import types

import pytest

from trnflow.errors import FatalError
from trnflow.records import RollbackLog, read
from trnflow.storage import open_store
from trnflow.workload.divergence import MIN_HISTORY, ROLLBACKS, Divergence


def _ctx(make_spec, **train):
    spec = make_spec(train={"on_divergence": "rollback", "spike_factor": 4.0, "max_rollbacks": 1, **train})
    return types.SimpleNamespace(spec=spec, rank=0, world_size=1, is_main=True)


def test_a_spike_is_a_loss_over_the_factor_times_the_recent_median_once_there_are_enough(make_spec, tmp_path):
    watch = Divergence(_ctx(make_spec), open_store(str(tmp_path)))
    assert watch.why(100.0) is None  # too few losses yet to tell a spike
    watch.losses.clear()
    for loss in [1.0, 0.9, 1.1, 1.0, 0.8][:MIN_HISTORY]:
        assert watch.why(loss) is None
    assert watch.why(3.9) is None  # under 4 x the median 1.0
    assert watch.why(4.5) == "loss 4.5 on rank 0, over 4 x the median 1 of its last 6 (train.spike_factor)"
    assert watch.why(float("nan")) == "loss nan on rank 0"
    assert 4.5 not in watch.losses  # a spike never joins the median it is measured against


def test_a_rollback_is_kept_beside_the_checkpoints_and_the_next_attempt_skips_its_step(make_spec, tmp_path):
    store = open_store(str(tmp_path))
    watch = Divergence(_ctx(make_spec, skip_steps=[3]), store)
    assert watch.skips == {3}
    watch.allowed(10, "loss nan on rank 1")
    watch.record(10, "loss nan on rank 1", 8, [4, 1, 7])
    kept = read(RollbackLog, store.read(ROLLBACKS), ROLLBACKS)
    assert [(r.step, r.restored_from, r.samples) for r in kept.rollbacks] == [(10, 8, [4, 1, 7])]
    again = Divergence(_ctx(make_spec, skip_steps=[3]), store)  # an attempt resuming from before step 10
    assert again.skips == {3, 10} and again.log == kept
    with pytest.raises(FatalError, match=r"diverged at step 11 \(loss inf on rank 0\) after 1 rollback\(s\) "
                                         r"\(train.max_rollbacks 1; made: step 10 \(loss nan on rank 1\): back to "
                                         r"step 8, 3 samples skipped\)"):
        again.allowed(11, "loss inf on rank 0")
