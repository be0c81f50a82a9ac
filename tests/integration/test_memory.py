"""The device-memory budget: estimated before launch, refused when it cannot fit, measured in a run."""

import pytest

from tests.conftest import tiny_m5
from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.errors import FatalError
from trnflow.settings import TrnflowSettings
from trnflow.workload.memory import check_fits, estimate, parameter_count
from trnflow.workload.programs import build_model


def test_parameter_count_is_exact():
    recipe = tiny_m5(vocab_size=500, d_model=32, n_heads=4, n_layers=2, ffn_dim=64, mlp_hidden=[16], seq_len=16)
    assert parameter_count(recipe) == sum(p.numel() for p in build_model(recipe, 0).parameters())


def test_an_oversized_job_is_refused_before_launch_with_both_numbers(make_spec, trnflow_home):
    spec = make_spec(model={"params": {"d_model": 4096, "n_heads": 32, "n_layers": 24, "ffn_dim": 16384,
                                       "vocab_size": 32000, "seq_len": 2048}})
    with pytest.raises(FatalError) as info:
        check_fits(spec)
    message = str(info.value)
    assert "GiB of device memory per NeuronCore" in message and "a trn1.2xlarge core has 16.0 GiB" in message
    assert "global_batch_size" in message
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    before = set(backend.jobs_dir.glob("*")) if backend.jobs_dir.exists() else set()
    with pytest.raises(FatalError):
        backend.submit(JobRequest(spec, "train", "big"))
    after = set(backend.jobs_dir.glob("*")) if backend.jobs_dir.exists() else set()
    assert after == before  # nothing was launched or written


def test_bf16_sr_halves_the_state_and_a_fitting_job_is_accepted(make_spec):
    fp32 = estimate(make_spec())
    sr = estimate(make_spec(compute={"precision": "bf16-sr"}))
    assert sr.weights * 2 == fp32.weights and sr.optimizer * 2 == fp32.optimizer
    assert check_fits(make_spec()).chosen.fits


def test_a_run_reports_the_bytes_each_rank_held(make_spec, trnflow_home):
    spec = make_spec(train={"steps": 2, "checkpoint_every": 2})
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    info = wait(backend, backend.submit(JobRequest(spec, "train", "mem")), 0.2)
    assert info.state is JobState.SUCCEEDED, info.failure
    memory = info.result.device_memory
    assert len(memory.peak_per_rank) == 2 and all(p > 0 for p in memory.peak_per_rank)
    # weights, gradients and AdamW moments are held exactly as estimated (fp32: 4, 4 and 8 bytes each)
    est = estimate(spec)
    assert memory.weights == est.weights and memory.gradients == est.gradients
    assert memory.activations > 0
