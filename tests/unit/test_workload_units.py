"""The workload's pieces, each checked on its own, in-process."""

import pytest
import torch

from tests.conftest import tiny_m5
from trnflow.emulator import compiler
from trnflow.emulator.device import EmulatorDevice
from trnflow.emulator.numerics import nearest_round_bf16_, stochastic_round_bf16_
from trnflow.measures import SweepRow
from trnflow.neuron.launch import parse_visible_cores
from trnflow.neuron.nccom import bus_factor
from trnflow.workload.programs import build_model
from trnflow.workload.sampler import StepSampler
from trnflow.workload.sanity import check_matmul


def test_sampler_position_is_a_function_of_the_step():
    a = StepSampler(1000, 32, rank=0, world=1, seed=5)
    b = StepSampler(1000, 32, rank=0, world=1, seed=5)
    assert torch.equal(a.indices(57), b.indices(57))  # no hidden state: jump straight to step 57
    assert not torch.equal(a.indices(0), a.indices(1))


def test_ranks_split_each_global_batch_whatever_the_world_size():
    one = StepSampler(1000, 32, 0, 1, seed=5).indices(40)
    two = torch.cat([StepSampler(1000, 32, r, 2, seed=5).indices(40) for r in range(2)])
    four = torch.cat([StepSampler(1000, 32, r, 4, seed=5).indices(40) for r in range(4)])
    assert torch.equal(one, two) and torch.equal(one, four)


def test_epochs_drop_the_partial_batch_and_reshuffle():
    s = StepSampler(100, 32, 0, 1, seed=1)
    assert s.steps_per_epoch == 3
    first_epoch = torch.cat([s.indices(i) for i in range(3)])
    assert len(set(first_epoch.tolist())) == 96
    assert not torch.equal(s.indices(0), s.indices(3))


def test_model_embeds_and_classifies():
    cfg = tiny_m5()
    model = build_model(cfg, seed=0).eval()
    tokens = torch.tensor([[1, 5, 9, 0, 0, 0, 0, 0], [1, 7, 3, 8, 2, 4, 0, 0]])
    assert model.embed(tokens).shape == (2, 16)
    assert model(tokens).shape == (2, 2)
    same = build_model(cfg, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = torch.full((200_000,), 1.0 + 2**-10)
    gen = torch.Generator().manual_seed(0)
    rounded = stochastic_round_bf16_(x.clone(), gen)
    assert set(rounded.unique().tolist()) <= {1.0, 1.0078125}  # the two bf16 neighbours
    assert abs(rounded.mean().item() - (1.0 + 2**-10)) < 1e-4  # nearest-even would be off by ~1e-3
    again = stochastic_round_bf16_(x.clone(), torch.Generator().manual_seed(0))
    assert torch.equal(rounded, again)


def test_rounding_to_nearest_loses_an_update_below_half_the_bf16_spacing():
    weight = torch.full((1000,), 1.0)
    nudged = nearest_round_bf16_(weight + 2**-10)  # a quarter of bf16's spacing at 1.0
    assert torch.equal(nudged, weight)  # the update is gone: pure bf16 without SR stalls here
    assert nearest_round_bf16_(torch.tensor([1.0 + 3 * 2**-9])).item() == 1.0078125  # over half: rounds up


def test_pure_bf16_rounds_weights_and_adam_moments_but_never_the_step_count():
    device = EmulatorDevice()
    assert device.rounding("bf16-rne") == "nearest" and device.rounding("bf16-sr") == "stochastic"
    assert device.rounding("fp32") is None and device.rounding("bf16") is None
    assert device.rounding("bf16", env={"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"}) == "stochastic"
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(16, 8)).square().mean().backward()
    optimizer.step()
    for _ in range(300):  # step counts above 256 are not bf16-representable
        optimizer.state[model.weight]["step"] += 1
    device.round_state(model, optimizer, "nearest", torch.Generator().manual_seed(0))
    on_grid = [model.weight, model.bias] + [optimizer.state[p][k] for p in (model.weight, model.bias)
                                            for k in ("exp_avg", "exp_avg_sq")]
    assert all(torch.equal(t, t.to(torch.bfloat16).float()) for t in on_grid)
    assert optimizer.state[model.weight]["step"].item() == 301.0


def test_known_answer_matmul_is_exact_in_fp32():
    result = check_matmul(torch.float32, seed=3)
    assert result.passed and result.max_rel_err == 0.0
    assert check_matmul(torch.bfloat16, seed=3).passed


def test_bus_bandwidth_factors_match_nccom_test():
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == 0.75
    assert bus_factor("reduce_scatter", 8) == 0.875


def test_wrong_collective_results_are_raised_or_reported_for_the_collectives_stage_to_fail_on(make_spec):
    """The sanity job's sweep reports wrong results instead of raising; the collectives stage, handed
    that sweep, fails naming the cores, as a sweep job of its own would have."""
    from types import SimpleNamespace

    from trnflow.errors import FatalError
    from trnflow.results import CollectivesResult
    from trnflow.tasks.collectives import collective_test
    from trnflow.workload.collectives import CorruptCollective, _summarise

    rows = [SweepRow(op="all_reduce", size=65536, time_us=10.0, busbw=1.0, correct=False, bad_cores=[3])]
    ctx = SimpleNamespace(world_size=2)
    with pytest.raises(CorruptCollective, match=r"core\(s\) \[3\] sent corrupted data") as raised:
        _summarise(ctx, ["all_reduce"], [65536], rows, "trnflow")
    assert raised.value.bad_cores == [3]
    reported = _summarise(ctx, ["all_reduce"], [65536], rows, "trnflow", report_wrong=True)
    assert reported["passed"] is False and reported["bad_cores"] == [3] and str(raised.value) == reported["note"]

    swept = CollectivesResult.model_validate({**reported, "phase": "sanity", "cores": [2, 3]})
    with pytest.raises(FatalError, match=r"all_reduce 65536B: core\(s\) \[3\]") as failed:
        collective_test.fn(make_spec(), "run", [2, 3], swept=swept)
    assert failed.value.bad_cores == [3] and not failed.value.retryable


def test_visible_cores_accept_an_index_or_an_inclusive_range():
    assert parse_visible_cores("3") == [3]
    assert parse_visible_cores("4-7") == [4, 5, 6, 7]


def _keys(model, tokens, optlevel=1) -> list[str]:
    from trnflow.emulator.jit import CachedCompiler

    recorder = CachedCompiler(compiler.compile_flags(optlevel, "fp32"), mode="extract")
    torch._dynamo.reset()
    torch.compile(model, backend=recorder, fullgraph=True, dynamic=False)(tokens)
    return [s.key for s in recorder.seen]


@pytest.mark.slow  # TorchDynamo traces and compiles the model: with the integration tests
def test_cache_key_is_the_same_for_the_same_model_and_flags():
    cfg = tiny_m5()
    tokens = torch.ones(4, 8, dtype=torch.long)
    keys = [_keys(build_model(cfg, seed=0), tokens) for _ in range(2)]
    assert keys[0] == keys[1] and len(keys[0]) == 1 and keys[0][0].startswith("MODULE_")
    model = build_model(cfg, seed=0)
    assert _keys(model, tokens, optlevel=2) != keys[0]  # other flags
    assert _keys(model, torch.ones(8, 8, dtype=torch.long)) != keys[0]  # other shapes
    with torch.no_grad():
        assert _keys(model, tokens) != keys[0]  # no backward: another program


@pytest.mark.slow  # TorchDynamo traces and compiles the model: with the integration tests
def test_a_run_at_o1_counts_each_graph_against_the_cache_then_runs_the_captured_graph(tmp_path):
    """O1 builds no code, so a run executes the captured graph itself (not its lowered ATen graphs),
    after the cache lookup and the recompilation guard; the gradients are eager's."""
    from trnflow.device.base import RecompileGuard
    from trnflow.device.cache import CompileCache
    from trnflow.emulator.jit import CachedCompiler

    flags = compiler.compile_flags(1, "fp32")
    gm = torch.fx.symbolic_trace(torch.nn.Linear(3, 2))
    assert compiler.runnable(gm, [torch.ones(1, 3)], flags) == gm.forward
    assert compiler.runnable(gm, [torch.ones(1, 3)], compiler.compile_flags(2, "fp32")) != gm.forward

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    tokens = torch.randn(4, 3)
    runner = CachedCompiler(flags, CompileCache(str(tmp_path / "cache")), mode="run", guard=RecompileGuard(limit=1),
                            inductor_dir=tmp_path / "inductor")
    torch._dynamo.reset()
    torch.compile(model, backend=runner, fullgraph=True, dynamic=False)(tokens).sum().backward()
    ran = [p.grad.clone() for p in model.parameters()]
    assert [s.outcome for s in runner.seen] == ["recompiled"] and runner.guard.count == 1  # an empty cache: a miss
    model.zero_grad()
    model(tokens).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ran, model.parameters(), strict=True))


def test_without_drop_last_the_epoch_ends_with_a_smaller_batch():
    dropping = StepSampler(100, 32, rank=1, world=2, seed=1)
    keeping = StepSampler(100, 32, rank=1, world=2, seed=1, drop_last=False)
    assert dropping.steps_per_epoch == 3 and keeping.steps_per_epoch == 4
    assert [len(keeping.indices(s)) for s in range(5)] == [16, 16, 16, 2, 16]  # 4 left over: 2 per rank
    assert torch.equal(keeping.indices(4), dropping.indices(3))  # the next epoch starts the same way


def test_static_batches_pad_the_last_batch_to_the_same_shape():
    from trnflow.workload.sampler import static_batches

    tokens = torch.randint(2, 300, (10, 6))
    batches = list(static_batches(tokens, torch.arange(10), 4))
    assert [b.shape for b, _ in batches] == [(4, 6)] * 3
    assert [real for _, real in batches] == [4, 4, 2]
    assert torch.equal(batches[2][0][:2], tokens[8:10])


def test_the_root_failure_of_a_job_is_the_rank_that_caused_it():
    from trnflow.backends.failures import root_failure
    from trnflow.results import FailureReport

    own = FailureReport(rank=1, type="HardwareError", retryable=True, message="nc3")
    peer = FailureReport(rank=0, type="DistBackendError", retryable=None, message="Connection closed by peer")
    assert root_failure([peer, own], 2) == own
    bug = FailureReport(rank=1, type="KeyError", retryable=None, message="'x'")
    assert root_failure([peer, bug], 2) == bug  # a plain error is not retried
    assert root_failure([peer], 2).type == "WorkerLost"  # rank 1 died without a word
    waited = FailureReport(rank=0, type="RuntimeError", retryable=None,
                           message="Application timeout caused pair closure")
    hung = root_failure([waited], 2)  # rank 1 stopped answering; rank 0 timed out waiting for it
    assert hung.type == "CollectiveTimeout" and hung.retryable and hung.ranks == [1]


def test_programs_put_the_whole_model_in_one_mode_so_an_evaluation_never_retraces_training(make_spec):
    """A pretrained model comes out of `from_pretrained` in eval mode, inside a wrapper in train mode:
    the programs set every module to the root's mode at once, else the first evaluation's switch
    flips the inner modules and training is traced again after it (as cached programs were loaded
    over the running ones, that second trace crashed at optlevel 2)."""
    from trnflow.device.registry import get_device
    from trnflow.workload.programs import Programs
    from trnflow.workload.recipes import recipe_for

    spec = make_spec(cores=1)
    recipe = recipe_for(spec)
    model = build_model(recipe, spec.train.seed)
    inner = next(m for m in model.modules() if m is not model)
    inner.eval()
    assert model.training and not inner.training
    device = get_device("emulator")
    Programs(spec, recipe, model, device.compiler(spec, "extract", model=recipe.key), device)
    assert all(m.training for m in model.modules())
