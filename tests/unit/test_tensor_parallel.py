"""Tensor parallelism's plan before anything runs: the spec's checks, each family's split of its
layers (LoRA adapters split with their layers), the memory planner's figures and `tp: auto`'s
choice, and `trnflow validate` saying what it chose or why it cannot split."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from trnflow.cli.app import app
from trnflow.errors import FieldError
from trnflow.reporting.history import RunShape
from trnflow.specs import Layout, SpecError, validate_spec
from trnflow.workload.memory import REHEARSAL_CORE_ENV, check_fits, decided, plan
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers and peft: about 20 s


def _spec(folder=None, cores: int = 2, tp: int | str = 2, strategy: str = "ddp", lora=None, **compute):
    params = {"pretrained": str(folder), "seq_len": 32, **({"lora": lora} if lora else {})}
    return validate_spec(quickstart_data(
        model={"recipe": "hf-causal-lm", "params": params}, gate={"metric": "perplexity", "metrics": []},
        compute={"cores_per_node": cores, **compute},
        train={"global_batch_size": 16 * cores, "parallelism": {"strategy": strategy, "tp": tp}}))


def test_tp_must_divide_the_cores_of_a_node_and_is_refused_on_torch_xla():
    with pytest.raises(SpecError, match=r"train.parallelism.tp: 3 does not divide compute.cores_per_node \(2\); "
                       r"tensor parallelism never crosses nodes, so use one of \[1, 2\]"):
        validate_spec(quickstart_data(train={"parallelism": {"tp": 3}}))
    with pytest.raises(SpecError, match=r"train\.parallelism\.tp does not run on the xla device"):
        validate_spec(quickstart_data(compute={"device": "xla"}, train={"parallelism": {"tp": 2}}))
    with pytest.raises(SpecError, match=r"min_cores_per_node: 3 is not a multiple of train\.parallelism\.tp"):
        validate_spec(quickstart_data(compute={"instance_type": "trn1.32xlarge", "cores_per_node": 8},
                                      train={"global_batch_size": 48, "parallelism": {"tp": 2,
                                                                                      "min_cores_per_node": 3}}))


def test_fewer_cores_after_a_hardware_error_still_hold_whole_tensor_parallel_groups():
    spec = validate_spec(quickstart_data(
        compute={"instance_type": "trn1.32xlarge", "cores_per_node": 8},
        train={"global_batch_size": 48, "parallelism": {"tp": 2, "min_cores_per_node": 2}}))
    assert spec.on_fewer_cores(7).compute.cores_per_node == 6  # 6 divides 48 and holds three groups of 2
    assert spec.on_fewer_cores(5).compute.cores_per_node == 4
    assert (spec.data_parallel_size, spec.per_core_batch) == (4, 12)  # each group computes its replica's 12


def test_a_llama_splits_its_attention_and_mlp_and_the_model_stays_whole_elsewhere(decoder_folder):
    recipe = recipe_for(_spec(decoder_folder))
    model = build_model(recipe, 0)
    split = recipe.tensor_plan(model, 2)
    assert split.colwise == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                             "mlp.up_proj")
    assert split.rowwise == ("self_attn.o_proj", "mlp.down_proj")
    assert len(split.blocks) == 2  # every transformer layer
    total, trains = split.split_parameters()
    layers = sum(p.numel() for block in split.blocks for p in block.parameters())
    norms = sum(p.numel() for block in split.blocks for name, p in block.named_parameters() if "norm" in name)
    assert total == trains == layers - norms  # every projection splits; the norms (and embeddings) stay whole


def test_lora_adapters_split_with_the_layers_they_adapt(decoder_folder):
    recipe = recipe_for(_spec(decoder_folder, lora={"r": 4, "alpha": 8}))
    split = recipe.tensor_plan(build_model(recipe, 0), 2)
    assert "self_attn.q_proj.base_layer" in split.colwise and "self_attn.q_proj.lora_B.default" in split.colwise
    assert "self_attn.o_proj.base_layer" in split.rowwise and "self_attn.o_proj.lora_A.default" in split.rowwise
    assert not any("lora_A" in path for path in split.colwise)  # the rank-r side stays whole
    total, trains = split.split_parameters()
    assert 0 < trains < total


def test_a_tp_that_does_not_divide_the_heads_is_refused_naming_them(decoder_folder):
    recipe = recipe_for(_spec(decoder_folder, cores=4, tp=4, instance_type="trn1.32xlarge"))
    with pytest.raises(FieldError, match=r"train.parallelism.tp: 4 does not divide the model's 2 attention heads "
                       r"\(num_key_value_heads\)"):
        recipe.tensor_plan(build_model(recipe, 0), 4)


def test_recipes_that_do_not_split_say_why_and_gpt2_splits_its_fused_attention_by_parts():
    m5 = recipe_for(validate_spec(quickstart_data()))
    with torch.device("meta"):
        model = m5.build_model()
    with pytest.raises(FieldError, match="m5-text does not split its layers"):
        m5.tensor_plan(model, 2)
    with torch.device("meta"):
        gpt2 = _gpt2()
        model = gpt2.build_model()
    split = gpt2.tensor_plan(model, 2)
    assert split.parts == {"attn.c_attn": 3} and split.resize == (("attn", "split_size", 16),)


def _gpt2():
    return recipe_for(validate_spec(quickstart_data(
        model={"recipe": "hf-causal-lm", "params": {"model_type": "gpt2", "vocab_size": 300, "seq_len": 32,
                                                    "config": {"n_embd": 32, "n_layer": 2, "n_head": 4}}},
        gate={"metric": "perplexity", "metrics": []})))


def test_the_planner_counts_a_split_layers_share_on_each_core(decoder_folder):
    whole, split = plan(_spec(decoder_folder, tp=1)), plan(_spec(decoder_folder, tp=2))
    assert (split.tp, split.chosen.layout) == (2, "ddp tp 2")
    recipe = recipe_for(_spec(decoder_folder))
    splits, _ = recipe.tensor_plan(build_model(recipe, 0), 2).split_parameters()
    assert whole.ddp.weights - split.ddp.weights == splits // 2 * 4  # fp32: half the split weights
    assert split.fsdp.weights == pytest.approx(split.ddp.weights, rel=0.01)  # one replica: nothing to shard over
    four = plan(_spec(decoder_folder, cores=4, tp=2, strategy="fsdp", instance_type="trn1.32xlarge"))
    assert four.fsdp.weights == pytest.approx(split.ddp.weights / 2, rel=0.01)  # two replicas shard it


def _wide(strategy: str, tp: int | str):
    """A Llama-style decoder whose weights, not its activations, fill a core: what splitting helps."""
    return validate_spec(quickstart_data(
        model={"recipe": "hf-causal-lm", "params": {
            "model_type": "llama", "vocab_size": 256, "seq_len": 16,
            "config": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 4}}},
        gate={"metric": "perplexity", "metrics": []},
        train={"global_batch_size": 2, "parallelism": {"strategy": strategy, "tp": tp}}))


def test_tp_auto_splits_only_a_model_too_big_for_a_core_and_validate_says_so(tmp_path, monkeypatch):
    spec = _wide("ddp", "auto")
    assert (plan(spec).strategy, plan(spec).tp) == ("ddp", 1)
    split, whole = plan(_wide("ddp", 2)).ddp, plan(_wide("ddp", 1)).ddp
    assert split.total < whole.total
    monkeypatch.setenv(REHEARSAL_CORE_ENV, str((split.total + whole.total) / 2 / 1024**3))
    found = check_fits(spec)
    assert (found.strategy, found.tp) == ("ddp", 2) and [e.layout for e in found.weighed] == ["ddp", "fsdp"]
    # with the strategy free too, sharding comes before splitting
    assert (plan(_wide("auto", "auto")).strategy, plan(_wide("auto", "auto")).tp) == ("fsdp", 1)
    path = tmp_path / "spec.yaml"
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["validate", str(path), "--no-data-check"])
    assert result.exit_code == 0, result.output
    assert "parallelism: ddp tp 2 per core" in " ".join(result.output.split())
    # undecided, the spec names no number; decided once, the value travels and every reader agrees
    for undecided in (lambda: spec.tp, lambda: spec.layout, lambda: spec.per_core_batch, lambda: RunShape.of(spec)):
        with pytest.raises(ValueError, match=r"train\.parallelism.*undecided"):
            undecided()
    chosen = decided(spec)
    assert chosen.layout == Layout(strategy="ddp", tp=2) == found.layout and chosen.data_parallel_size == 1
    assert RunShape.of(chosen).tp == 2 and decided(chosen) is chosen and spec.train.parallelism.tp == "auto"


def test_validate_refuses_a_split_the_model_cannot_take_before_anything_runs(decoder_folder, tmp_path):
    path = tmp_path / "spec.yaml"
    spec = _spec(decoder_folder, cores=4, tp=4, instance_type="trn1.32xlarge")
    path.write_text(json.dumps(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["validate", str(path), "--no-data-check"])
    assert result.exit_code == 2, result.output
    said = " ".join(result.output.split())
    assert "train.parallelism.tp: 4 does not divide the model's 2 attention heads" in said
    assert "Traceback" not in result.output
