"""LoRA adapters (model.params.lora) on hf-causal-lm and hf-encoder: the recipe contract, only the
adapters train and are saved, a checkpoint names its base and is refused on another, the memory
planner counts a frozen base as it is, and the export loads both ways (peft, and merged)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from tests.conftest import quickstart_data
from trnflow.errors import FatalError, FieldError
from trnflow.records import CheckpointMeta, DataRead
from trnflow.specs import SpecError, validate_spec
from trnflow.testing.recipe_contract import RecipeContract
from trnflow.workload.checkpoint import (
    Checkpoint,
    frozen,
    load_model_weights,
    on_base,
    trainable,
    trained_state,
)
from trnflow.workload.memory import plan
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for
from trnflow.workload.recipes.lora import ADAPTER_FOLDER, LoraParams, folder_digest, targets

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers and peft: about 40 s

LORA = {"r": 4, "alpha": 8}


def _spec(folder: Path, recipe: str = "hf-causal-lm", **params):
    gate = {"metric": "perplexity", "metrics": []} if recipe == "hf-causal-lm" else {}
    return validate_spec(quickstart_data(model={"recipe": recipe, "params": {
        "pretrained": str(folder), "seq_len": 32, "lora": LORA, **params}}, gate=gate))


class TestLoraCausalLm(RecipeContract):
    """The contract holds for a decoder with adapters: only they train."""

    recipe = "hf-causal-lm"

    @pytest.fixture(autouse=True)
    def _rows(self, prompts, decoder_folder):
        self._table = prompts
        self.params = {"pretrained": str(decoder_folder), "seq_len": 32, "lora": LORA}

    def rows(self) -> pa.Table:
        return self._table


def test_only_the_adapters_train_and_a_checkpoint_holds_only_them(decoder_folder):
    recipe = recipe_for(_spec(decoder_folder))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # none of peft's and transformers' reaches the user
        model = build_model(recipe, 0)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert {n.split(".")[-4] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"}  # every linear layer of the block
    assert sum(p.numel() for p in trainable(model)) == sum(p.numel() for n, p in model.named_parameters()
                                                           if n in names)
    state = trained_state(model)
    assert set(state) == names  # the base, its tied head included, is left out
    assert "lm.base_model.model.lm_head.weight" in frozen(model)
    optimizer = recipe.optimizer(trainable(model), _spec(decoder_folder).train)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)


def test_the_base_is_named_by_its_folders_digest_and_another_base_is_refused(decoder_folder, tmp_path):
    recipe = recipe_for(_spec(decoder_folder))
    base = recipe.base()
    assert base == folder_digest(decoder_folder) and len(base) == 64
    assert recipe_for(_spec(decoder_folder, lora=None)).base() is None  # every weight trains and is saved

    other = tmp_path / "other"
    shutil.copytree(decoder_folder, other)
    (other / "config.json").write_text((other / "config.json").read_text().replace("}", ', "note": 1}', 1))
    theirs = recipe_for(_spec(other)).base()
    assert theirs != base

    model = build_model(recipe, 0)
    meta = CheckpointMeta(run_id="r", step=1, global_step=1, spec_digest="d", precision="fp32", world_size=1,
                          sampler={}, data=DataRead(), recipe=recipe.describe(), torch=torch.__version__, base=base)
    ckpt = Checkpoint("ckpts/r/step-000001", 1, model=trained_state(model), meta=meta)
    assert on_base(ckpt, base)
    load_model_weights(build_model(recipe, 1), ckpt.model, ckpt.url, without_frozen=True)
    with pytest.raises(FatalError, match=f"trained on the base with digest {base}.*has digest {theirs}"):
        on_base(ckpt, theirs)
    with pytest.raises(FatalError, match="holds adapters trained on a frozen base"):
        on_base(ckpt, None)
    with pytest.raises(FatalError, match="missing"):  # unless the base may be left out, adapters alone are not enough
        load_model_weights(build_model(recipe, 1), ckpt.model, ckpt.url)


def test_the_memory_plan_counts_a_frozen_base_without_gradients_or_optimizer_state(decoder_folder):
    lora, full = plan(_spec(decoder_folder)).ddp, plan(_spec(decoder_folder, lora=None)).ddp
    assert lora.trainable and lora.trainable < full.parameters / 5 and full.trainable is None
    assert lora.parameters == full.parameters + lora.trainable and lora.weights == lora.parameters * 4  # fp32
    assert lora.gradients == lora.trainable * 4 and lora.optimizer == 2 * lora.trainable * 4
    assert "parameters train" in lora.describe() and "parameters train" not in full.describe()


def test_the_export_is_the_adapter_in_peft_format_and_the_model_merged(decoder_folder, prompts, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    recipe = recipe_for(_spec(decoder_folder))
    recipe.fit(prompts)
    model = build_model(recipe, 0)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for p in trainable(model):
            p.add_(torch.randn_like(p) * 0.05)
    ids = recipe.features(prompts.slice(0, 4))[:, 0]
    with torch.no_grad():
        want = model.lm(input_ids=ids).logits
    assert recipe.export(model, tmp_path)
    assert (tmp_path / ADAPTER_FOLDER / "adapter_config.json").is_file()
    assert (tmp_path / ADAPTER_FOLDER / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(decoder_folder)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / ADAPTER_FOLDER)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-4, atol=1e-5)
    assert not any("lora" in k for k in merged.state_dict())


def test_an_encoders_adapters_and_new_head_train(tmp_path):
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=32)).save_pretrained(tmp_path)
    model = build_model(recipe_for(_spec(tmp_path, "hf-encoder", seq_len=16, vocab_size=300)), 0)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {"head.weight", "head.bias"} < names
    adapted = names - {"head.weight", "head.bias"}
    assert {n.split(".")[-4] for n in adapted} == {"query", "key", "value", "dense"}
    assert not any("pooler" in n for n in adapted)  # unused, so removed before adapting


def test_lora_needs_a_pretrained_model_and_layers_it_has(decoder_folder):
    with pytest.raises(SpecError, match="lora: adapters train on a pretrained model"):
        recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-causal-lm", "params": {"lora": {}}},
                                                 gate={"metric": "perplexity", "metrics": []})))
    with pytest.raises(FieldError, match=r"no layers named \['c_attn'\]"):
        build_model(recipe_for(_spec(decoder_folder, lora={"target_modules": ["c_attn"]})), 0)
    assert targets(LoraParams(), "qwen3") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"]
    assert targets(LoraParams(), "gpt2") == ["c_attn", "c_proj", "c_fc"]
    with pytest.raises(FieldError, match="no default for model type 'mamba'"):
        targets(LoraParams(), "mamba")


def test_a_lora_programs_cache_keys_are_not_the_full_models(decoder_folder, prompts):
    from trnflow.emulator import compiler
    from trnflow.emulator.jit import CachedCompiler

    def keys(spec) -> list[str]:
        recipe = recipe_for(spec)
        recipe.fit(prompts)
        recorder = CachedCompiler(compiler.compile_flags(1, "fp32"), mode="extract")
        torch._dynamo.reset()
        try:
            torch.compile(build_model(recipe, 0), backend=recorder, fullgraph=True, dynamic=False)(
                recipe.features(prompts.slice(0, 4)))
        finally:
            torch._dynamo.reset()
        return [s.key for s in recorder.seen]

    lora, full = keys(_spec(decoder_folder)), keys(_spec(decoder_folder, lora=None))
    assert lora and full and set(lora).isdisjoint(full)
    assert keys(_spec(decoder_folder, lora={"r": 8})) != lora  # another rank: another program


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_the_low_rank_first_forward_gives_peft_s_outputs_and_gradients(model_type):
    """The adapted layers run trnflow's forward (scale on the rank-r side, one addmm against B's
    transpose); its outputs and every adapter's gradient equal peft's own forward's within rounding,
    with B set away from zero (peft starts it at zero, which would hide the adapters)."""
    import copy

    import peft
    from transformers import AutoConfig, AutoModelForCausalLM

    from trnflow.workload.recipes.lora import adapt

    config = ({"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 2, "vocab_size": 64} if model_type == "llama"
              else {"n_embd": 16, "n_layer": 2, "n_head": 2, "vocab_size": 64})
    torch.manual_seed(0)
    ours = adapt(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config)), LoraParams(r=4),
                 model_type).eval()  # (GPT-2's dropout off: the two forwards draw no random masks)
    adapted = [m for m in ours.modules() if isinstance(m, peft.tuners.lora.Linear)]
    assert adapted and all(type(m) is not peft.tuners.lora.Linear for m in adapted)
    with torch.no_grad():
        for m in adapted:
            m.lora_B["default"].weight.normal_()
    theirs = copy.deepcopy(ours)
    for m in theirs.modules():
        if isinstance(m, peft.tuners.lora.Linear):
            m.__class__ = peft.tuners.lora.Linear
    ids = torch.randint(0, 64, (3, 12))
    outputs = []
    for model in (ours, theirs):
        logits = model(input_ids=ids).logits
        logits.square().mean().backward()
        outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (mine, my_grads), (peft_logits, peft_grads) = outputs
    assert not torch.equal(mine, unwrapped_logits(theirs, ids))  # the adapters change the output
    torch.testing.assert_close(mine, peft_logits, rtol=1e-5, atol=1e-5)
    assert my_grads.keys() == peft_grads.keys() and len(my_grads) == 2 * len(adapted)
    for name, grad in my_grads.items():
        torch.testing.assert_close(grad, peft_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def unwrapped_logits(model, ids):
    with torch.no_grad(), model.disable_adapter():
        return model(input_ids=ids).logits
