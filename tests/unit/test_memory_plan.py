"""The memory planner: per-core figures of both strategies, `auto`'s choice, and what a refusal
says; and the names a sharded run keys optimizer state by."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import quickstart_data
from trnflow.backends import JobRequest
from trnflow.backends.base import fitted
from trnflow.errors import FatalError
from trnflow.specs import SpecError, validate_spec
from trnflow.workload.memory import (
    GIB,
    REHEARSAL_CORE_ENV,
    REHEARSAL_HOST_ENV,
    _runnable,
    check_fits,
    plan,
    staged_per_node,
)
from trnflow.workload.sharding import by_name


def _spec(strategy: str = "auto", cores: int = 2, checkpoint_async: bool = True, **compute):
    train = {"global_batch_size": 16 * cores, "parallelism": {"strategy": strategy},
             "checkpoint_async": checkpoint_async}
    return validate_spec(quickstart_data(compute={"cores_per_node": cores, **compute}, train=train))


def test_auto_takes_ddp_when_the_model_fits_a_core():
    found = plan(_spec())
    assert found.strategy == "ddp" and found.ddp.fits and found.chosen is found.ddp
    # sharded over 2 cores: half the weights, gradients and optimizer state, whole blocks gathered besides
    assert found.fsdp.weights == pytest.approx(found.ddp.weights / 2, rel=0.01)
    assert found.fsdp.optimizer == pytest.approx(found.ddp.optimizer / 2, rel=0.01)
    assert found.fsdp.gathered > 0 and found.ddp.gathered == 0
    assert found.fsdp.activations == found.ddp.activations


def test_recomputed_activations_are_counted_smaller_the_more_is_recomputed():
    figures = {}
    for setting in ("none", "selective", "full"):
        spec = validate_spec(quickstart_data(train={"global_batch_size": 32, "activation_checkpointing": setting}))
        figures[setting] = plan(spec).ddp
    assert figures["full"].activations < figures["selective"].activations < figures["none"].activations
    assert figures["full"].weights == figures["none"].weights  # nothing but the activations changes
    assert [f.recomputed for f in figures.values()] == ["none", "selective", "full"]
    assert "activations (full recomputation) " in figures["full"].describe()
    assert "recomputation" not in figures["none"].describe()


def test_auto_recomputes_before_it_shards_and_a_refusal_names_the_recomputation_that_would_fit(monkeypatch):
    def spec(**train):
        return validate_spec(quickstart_data(compute={"cores_per_node": 2}, train={"global_batch_size": 32, **train}))

    plain, selective = plan(spec()), plan(spec(activation_checkpointing="selective"))
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str((plain.ddp.total + selective.ddp.total) / 2 / GIB))
    found = check_fits(spec(activation_checkpointing="auto"))  # ddp fits once its blocks recompute selectively
    assert (found.strategy, found.layout.recompute, found.ddp.recomputed) == ("ddp", "selective", "selective")
    assert found.describe().startswith("parallelism: ddp per core: ddp ")
    decided = fitted(JobRequest(spec(activation_checkpointing="auto"), "train", "r1")).spec
    assert decided.train.activation_checkpointing == "selective" and decided.layout == found.layout
    assert decided.layout.describe() == "ddp, selective recomputation"
    with pytest.raises(FatalError, match=r"; or set train\.activation_checkpointing: selective \(or auto\)"):
        check_fits(spec(parallelism={"strategy": "ddp"}))
    assert check_fits(spec()).strategy == "fsdp"  # recomputing is the spec's to ask for, or auto's


def test_full_recomputation_of_split_layers_is_refused_and_the_planner_leaves_it_out():
    with pytest.raises(SpecError, match=r"train\.activation_checkpointing: full with train\.parallelism\.tp 2 "
                                        r"cannot run yet .*use selective"):
        validate_spec(quickstart_data(compute={"cores_per_node": 2},
                                      train={"parallelism": {"tp": 2}, "activation_checkpointing": "full"}))
    assert _runnable(["none", "selective", "full"], 2) == ["none", "selective"]
    assert _runnable(["full"], 2) == [] and _runnable(["full"], 1) == ["full"]  # a spec's full: tp 1 only


def test_auto_shards_a_model_too_big_for_a_rehearsed_core(monkeypatch):
    spec = _spec()
    both = plan(spec)
    between = (both.ddp.total + both.fsdp.total) / 2 / 1024**3  # more than fsdp needs, less than ddp
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str(between))
    found = check_fits(spec)
    assert found.strategy == "fsdp" and not found.ddp.fits and found.fsdp.fits and found.fsdp.rehearsal
    assert "(rehearsal)" in found.describe() and found.describe().startswith("parallelism: fsdp per core: ddp ")
    request = fitted(JobRequest(spec, "train", "r1"))
    assert request.spec.layout == found.layout and spec.train.parallelism.strategy == "auto"


def test_ddp_that_cannot_fit_is_refused_naming_fsdp(monkeypatch):
    spec = _spec("ddp")
    both = plan(spec)
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str((both.ddp.total + both.fsdp.total) / 2 / 1024**3))
    with pytest.raises(FatalError, match=r"Set train\.parallelism\.strategy: fsdp"):
        check_fits(spec)


def test_a_model_nothing_fits_is_refused_with_the_smallest_that_would(monkeypatch):
    spec = _spec()
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str(plan(spec).fsdp.total * 0.9 / 1024**3))
    with pytest.raises(FatalError) as refused:
        check_fits(spec)
    assert "the smallest that fits:" in str(refused.value) and "with train.parallelism.strategy fsdp" in str(
        refused.value)
    monkeypatch.setenv(REHEARSAL_CORE_ENV, "lots")
    with pytest.raises(FatalError, match=f"{REHEARSAL_CORE_ENV}: 'lots' is not a number of GiB"):
        check_fits(spec)


def test_checkpoints_written_in_the_background_must_fit_half_the_hosts_memory(monkeypatch):
    """The host copy of a checkpoint written in the background: rank 0's trained state for a whole
    one, every rank's shard for a sharded one; refused, naming the field, past half the host."""
    whole, sharded = _spec("ddp"), _spec("fsdp")
    ddp, fsdp = plan(whole).chosen, plan(sharded).chosen
    assert staged_per_node(whole, ddp) == ddp.gradients + ddp.optimizer
    staged = staged_per_node(sharded, fsdp)
    assert staged == 2 * (fsdp.gradients + fsdp.optimizer)  # each of the node's two ranks, its shard
    assert staged_per_node(_spec("fsdp", checkpoint_async=False), fsdp) == 0
    monkeypatch.setenv(REHEARSAL_HOST_ENV, str(staged * 1.5 / GIB))  # half of it holds less than the copy
    with pytest.raises(FatalError) as refused:
        check_fits(sharded)
    said = str(refused.value)
    assert said.startswith("train.checkpoint_async: a checkpoint written in the background is first copied into "
                           "host memory") and "in this rehearsal" in said, said
    assert "Set train.checkpoint_async: false" in said
    check_fits(_spec("fsdp", checkpoint_async=False))  # written in step: no copy kept while training goes on
    monkeypatch.setenv(REHEARSAL_HOST_ENV, str(staged * 2.5 / GIB))
    check_fits(sharded)


def test_sharding_is_refused_on_torch_xla_with_the_reason():
    with pytest.raises(SpecError, match="fsdp does not run on the xla device"):
        _spec("fsdp", device="xla")


def test_optimizer_state_saved_by_position_is_read_by_name():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    plain = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0}])
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    named = by_name(model, optimizer, optimizer.state_dict())
    assert [g["params"] for g in named["param_groups"]] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    assert torch.equal(named["state"]["2.bias"]["exp_avg"], optimizer.state[model[2].bias]["exp_avg"])
    assert by_name(model, optimizer, named) is named  # already by name


def test_after_a_hardware_error_a_spec_trains_on_fewer_cores_only_as_far_as_it_allows():
    def spec(**parallelism):
        return validate_spec(quickstart_data(
            compute={"instance_type": "trn1.32xlarge", "cores_per_node": 8},
            train={"global_batch_size": 48, "parallelism": {"strategy": "fsdp", **parallelism}}))

    assert spec().on_fewer_cores(7) is None  # no floor: an attempt needs all eight
    floored = spec(min_cores_per_node=2)
    assert floored.on_fewer_cores(8) is None  # enough healthy cores: unchanged
    assert floored.on_fewer_cores(7).compute.cores_per_node == 6  # the most that divide 48
    assert floored.on_fewer_cores(5).compute.cores_per_node == 4
    assert floored.on_fewer_cores(1) is None  # below the floor
    assert floored.on_fewer_cores(7).train.parallelism.strategy == "fsdp"
    with pytest.raises(SpecError, match=r"train.parallelism.min_cores_per_node: 9 is more than compute.cores_per_node"):
        spec(min_cores_per_node=9)


def test_a_local_retry_after_a_hardware_error_trains_on_the_cores_left_and_a_cloud_one_does_not():
    import logging

    from trnflow.tasks.train import _on_the_cores_left

    said: list[str] = []
    logger = logging.getLogger("trnflow.tests.cores-left")
    logger.addHandler(handler := logging.Handler())
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    local = validate_spec(quickstart_data(compute={"instance_type": "trn1.2xlarge", "cores_per_node": 2},
                                          train={"parallelism": {"min_cores_per_node": 1}}))
    fewer = _on_the_cores_left(local, {1}, logger)
    assert fewer.compute.cores_per_node == 1 and fewer.compute.world_size == 1
    assert "has 1 healthy NeuronCore(s) left; this attempt trains on 1 of them instead of 2" in said[0]
    assert _on_the_cores_left(local, {5}, logger) is local  # not a core of this instance: both still healthy
    cloud = local.model_copy(update={"compute": local.compute.model_copy(update={"backend": "sagemaker"})})
    assert _on_the_cores_left(cloud, {1}, logger) is cloud  # a cloud retry gets new instances


def test_the_smallest_that_fits_is_one_the_spec_could_run(monkeypatch):
    """A core too small for 2 sharded ranks: the suggestion is the fewest cores that fit and divide
    the batch, on one instance or several. An xla spec (trn1 only, where fsdp does not run) is never
    told to shard, and `auto` takes ddp there."""
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str(8.0e6 / 1024**3))

    def refusal(**sections) -> str:
        with pytest.raises(FatalError) as refused:
            check_fits(validate_spec(quickstart_data(**sections)))
        return str(refused.value)

    def suggested(text: str) -> int:
        return int(text.split("the smallest that fits: ")[1].split("(")[1].split(" cores")[0])

    for batch in (48, 64, 96):
        cores = suggested(refusal(train={"global_batch_size": batch}))
        assert batch % cores == 0 and cores > 2, (batch, cores)
        fewer = max(c for c in range(1, cores) if batch % c == 0)  # the next smaller count does not fit
        assert "smallest" in refusal(compute={"instance_type": "trn1.32xlarge", "cores_per_node": fewer},
                                     train={"global_batch_size": batch, "parallelism": {"strategy": "fsdp"}})
    xla = refusal(compute={"device": "xla", "instance_type": "trn1.32xlarge"},
                  train={"global_batch_size": 64, "parallelism": {"strategy": "ddp"}})
    assert "no instance in the catalogue fits it" in xla and "fsdp" not in xla.split(". ")[-1]
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str(9.95e6 / 1024**3))  # fsdp would fit 2 cores: not on xla
    for strategy in ("ddp", "auto"):
        xla = refusal(compute={"device": "xla", "instance_type": "trn1.32xlarge"},
                      train={"global_batch_size": 64, "parallelism": {"strategy": strategy}})
        assert "Set train.parallelism.strategy: fsdp" not in xla and "with ddp" in xla
