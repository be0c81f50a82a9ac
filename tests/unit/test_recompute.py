"""Activation checkpointing (`train.activation_checkpointing`): the recipe's blocks recompute what
their forward pass computed, keep less for backward, and train to the same losses and gradients,
dropout included; in eager PyTorch and through the compile backend the runs use."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.conftest import tiny_m5
from trnflow.workload.memory import saved_activation_peak
from trnflow.workload.programs import build_model
from trnflow.workload.recompute import SETTINGS, recompute


def _model(setting: str, **params):
    recipe = tiny_m5(n_layers=3, d_model=32, ffn_dim=128, seq_len=16, **params)
    model = build_model(recipe, seed=0)
    assert recompute(recipe.blocks(model), setting, recipe.saved_ops) == (0 if setting == "none" else 3)
    return model


def _step(model, tokens, labels, forward=None) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """One training step's loss and gradients (dropout seeded alike), and the bytes kept for backward
    (of an eager step: a compiled one, `forward`, keeps them inside its graph's function)."""
    torch.manual_seed(7)
    with saved_activation_peak() if forward is None else contextlib.nullcontext({"peak": 0}) as saved:
        loss = torch.nn.functional.cross_entropy((model if forward is None else forward)(tokens), labels)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], saved["peak"]


def test_recomputed_blocks_keep_their_activations_out_of_autograd_and_train_to_the_same_loss_and_gradients():
    tokens = torch.randint(1, 300, (8, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1] * 4)
    runs = {setting: _step(_model(setting), tokens, labels) for setting in SETTINGS}
    loss, grads, kept = runs["none"]
    for setting in ("selective", "full"):
        assert torch.equal(runs[setting][0], loss), setting  # the same dropout masks, replayed
        assert all(torch.equal(a, b) for a, b in zip(runs[setting][1], grads, strict=True)), setting
    # what autograd keeps outside the checkpoints (a selective block's own kept outputs live inside its
    # checkpoint, out of the hooks' sight: the planner's figures and the benchmark weigh those)
    assert runs["full"][2] < kept * 0.1 and runs["selective"][2] < kept * 0.1, {s: r[2] for s, r in runs.items()}


def test_a_block_is_wrapped_once_an_evaluation_runs_its_plain_forward_and_a_bad_setting_is_named():
    recipe = tiny_m5()
    model = build_model(recipe, seed=0)
    blocks = recipe.blocks(model)
    assert recompute(blocks, "full", recipe.saved_ops) == len(blocks) == 1
    assert recompute(blocks, "selective", recipe.saved_ops) == 0  # wrapped already: left as it is
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in build_model(recipe, seed=0).named_parameters()]  # checkpoints see the same model
    model.eval()
    with torch.no_grad(), saved_activation_peak() as saved:
        model(torch.ones(2, 8, dtype=torch.long))
    assert saved["peak"] == 0
    with pytest.raises(ValueError, match="the settings are none, selective, full"):
        recompute(blocks, "some", recipe.saved_ops)


@pytest.mark.slow  # TorchDynamo traces and compiles the model: with the integration tests
def test_compiled_as_the_runs_compile_it_the_losses_and_gradients_equal_and_the_graph_is_its_own(tmp_path):
    """At O1 a run executes the captured graph, but one that recomputes runs its lowered graphs,
    whose recomputation replays dropout's random stream (`compiler.runnable`)."""
    from trnflow.device.base import RecompileGuard
    from trnflow.device.cache import CompileCache
    from trnflow.emulator import compiler
    from trnflow.emulator.jit import CachedCompiler

    tokens = torch.randint(1, 300, (8, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1] * 4)
    runs, keys = {}, {}
    for setting in SETTINGS:
        model = _model(setting)
        recorder = CachedCompiler(compiler.compile_flags(1, "fp32"), CompileCache(str(tmp_path / "cache")),
                                  mode="run", guard=RecompileGuard(limit=10), inductor_dir=tmp_path / "inductor")
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=recorder, fullgraph=True, dynamic=False)
        runs[setting] = _step(model, tokens, labels, compiled)
        keys[setting] = [s.key for s in recorder.seen]
    loss, grads, _ = runs["none"]
    for setting in ("selective", "full"):
        assert torch.equal(runs[setting][0], loss), setting
        assert all(torch.equal(a, b) for a, b in zip(runs[setting][1], grads, strict=True)), setting
    assert len({k for found in keys.values() for k in found}) == 3  # a cache key of each setting's own


@pytest.mark.slow  # transformers, and its model compiled: with the integration tests
def test_a_transformers_decoder_recomputes_its_layers_to_the_same_loss_and_gradients(tmp_path):
    """hf-causal-lm's blocks are the decoder's layers, called with keyword arguments (its position
    embeddings, its mask); with attention dropout, eager and as a run compiles it."""
    from tests.unit.test_causal_lm import _recipe
    from trnflow.device.base import RecompileGuard
    from trnflow.device.cache import CompileCache
    from trnflow.emulator import compiler
    from trnflow.emulator.jit import CachedCompiler

    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "tie_word_embeddings": True, "attention_dropout": 0.2}
    recipe = _recipe(config=config)
    rows = recipe.example(4, torch.Generator().manual_seed(0))
    runs = {}
    for setting in SETTINGS:
        for compiled in (False, True):
            model = build_model(recipe, seed=0)
            assert recompute(recipe.blocks(model), setting, recipe.saved_ops) == (0 if setting == "none" else 2)
            forward = model
            if compiled:
                runner = CachedCompiler(compiler.compile_flags(1, "fp32"), CompileCache(str(tmp_path / "cache")),
                                        mode="run", guard=RecompileGuard(limit=10),
                                        inductor_dir=tmp_path / "inductor")
                torch._dynamo.reset()
                forward = torch.compile(model, backend=runner, fullgraph=True, dynamic=False)
            torch.manual_seed(7)
            loss = recipe.loss(forward(rows), None)
            loss.backward()
            runs[setting, compiled] = (loss.detach(), [p.grad.clone() for p in model.parameters()])
    for compiled in (False, True):
        loss, grads = runs["none", compiled]
        for setting in ("selective", "full"):
            got, got_grads = runs[setting, compiled]
            assert torch.equal(got, loss), (setting, compiled)
            assert all(torch.equal(a, b) for a, b in zip(got_grads, grads, strict=True)), (setting, compiled)
