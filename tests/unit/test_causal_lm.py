"""hf-causal-lm: the recipe contract on prompt/completion and on text rows, which tokens count, a
pretrained folder's own tokenizer, losses as transformers computes them, and the export."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pytest
import torch

from tests.conftest import quickstart_data
from trnflow.errors import FieldError
from trnflow.specs import validate_spec
from trnflow.testing.recipe_contract import RecipeContract
from trnflow.workload.recipes import recipe_for

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers, and its models compiled: with the integration tests

SMALL = {"config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "tie_word_embeddings": True}, "vocab_size": 300, "seq_len": 32}


def _recipe(**params):
    return recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-causal-lm", "params": {**SMALL, **params}},
                                                    gate={"metric": "perplexity", "metrics": []})))


class TestHfCausalLm(RecipeContract):
    """Prompt/completion rows, a decoder built from a small config and a trained tokenizer."""

    recipe = "hf-causal-lm"
    params: ClassVar[dict] = SMALL

    @pytest.fixture(autouse=True)
    def _rows(self, prompts):
        self._table = prompts

    def rows(self) -> pa.Table:
        return self._table


class TestHfCausalLmOnText(TestHfCausalLm):
    """Text rows: every token is trained on."""

    params: ClassVar[dict] = {**SMALL, "rows": "text"}


def test_only_the_completion_and_its_end_count_and_a_long_prompt_loses_its_start(prompts):
    recipe = _recipe(seq_len=12)
    recipe.fit(prompts)
    tok = recipe.tokenizer.tokenizer
    rows = pa.table({"prompt": ["Review: a b c d e f g h i j k l m n o p\nSentiment:", "Hi"],
                     "completion": [" positive", " negative"]})
    features = recipe.features(rows)
    completion = tok(" positive", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids, real, counted = features[0]
    assert real.tolist() == [1] * 12  # cut to seq_len
    assert ids[-len(completion):].tolist() == completion and counted.tolist() == [0] * (12 - len(completion)) + [
        1] * len(completion)
    prompt = tok("Review: a b c d e f g h i j k l m n o p\nSentiment:")["input_ids"]
    kept = 12 - len(completion) - 1
    assert ids[0] == tok.bos_token_id and ids[1:1 + kept].tolist() == prompt[-kept:]  # <s>, then the prompt's end
    short_ids, short_real, short_counted = features[1]
    n = int(short_real.sum())
    assert short_ids[n:].tolist() == [tok.pad_token_id] * (12 - n)  # padded at the end, never counted
    assert short_counted[n:].sum() == 0 and short_ids[0] == tok.bos_token_id


def test_a_pretrained_folders_tokenizer_gives_the_ids_and_the_loss_is_transformers_own(decoder_folder, prompts):
    """A Llama-style tokenizer without a pad token pads with its end-of-sequence token; the loss of
    a row whose every token counts is the one transformers computes, and so is a padded batch's of
    prompts and completions, transformers ignoring the prompts and padding (label -100)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = _recipe(pretrained=str(decoder_folder), rows="text", seq_len=48)
    recipe.fit(prompts)
    theirs = AutoTokenizer.from_pretrained(decoder_folder, local_files_only=True)
    assert theirs.pad_token is None and recipe.tokenizer.pad_id == theirs.eos_token_id
    text = "the best thing i have bought in years"
    features = recipe.features(pa.table({"text": [text]}))
    expected = theirs(text)["input_ids"] + [theirs.eos_token_id]
    assert features[0, 0, :len(expected)].tolist() == expected
    model = recipe.build_model().eval()
    lm = AutoModelForCausalLM.from_pretrained(decoder_folder, local_files_only=True).eval()
    with torch.no_grad():
        ours = recipe.loss(model(features), torch.zeros(1, dtype=torch.long))
        ids = torch.tensor([expected])
        assert ours.item() == pytest.approx(lm(ids, labels=ids).loss.item(), rel=1e-5)
    pairs = _recipe(pretrained=str(decoder_folder), seq_len=48)
    pairs.fit(prompts)
    rows = prompts.slice(0, 6)
    features = pairs.features(rows)
    labels = features[:, 0].masked_fill(features[:, 2] == 0, -100)
    assert 0 < (labels != -100).sum() < features[:, 1].sum()  # prompts and padding do not count
    with torch.no_grad():
        ours = pairs.loss(pairs.build_model().eval()(features), torch.zeros(6, dtype=torch.long))
        assert ours.item() == pytest.approx(lm(features[:, 0], labels=labels).loss.item(), rel=1e-5)


def test_metrics_are_per_counted_token_and_inference_publishes_likelihoods(prompts):
    recipe = _recipe()
    outputs = torch.tensor([[6.0, 3.0, 1.0], [2.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    values = recipe.evaluate(outputs, torch.zeros(3, dtype=torch.long), ["perplexity"])
    assert values == pytest.approx({"loss": 2.0, "perplexity": 7.38905609893065, "token_accuracy": 0.5})
    assert recipe.outcomes(outputs, torch.zeros(3)) is None
    published = recipe.publish(torch.tensor([[0.5, -0.5, 6.0, 3.0], [1.0, 1.0, 0.0, 0.0]]))
    assert published["embedding"].tolist() == [[0.5, -0.5], [1.0, 1.0]]
    assert published["log_likelihood"].tolist() == [-6.0, -0.0] and published["tokens"].tolist() == [3, 0]
    assert published["perplexity"][0].item() == pytest.approx(7.389056) and published["perplexity"][1].isnan()


def test_a_holdout_with_no_counted_token_names_seq_len():
    """Every chat cut before its assistant's turn: no token counts, and the evaluation says which
    field to raise, instead of metrics with no value."""
    recipe = _recipe(rows="chat")
    with pytest.raises(FieldError) as raised:
        recipe.evaluate(torch.zeros(300, 3, dtype=torch.float64), torch.zeros(300, dtype=torch.long), [])
    assert raised.value.field == "model.params.seq_len"
    assert str(raised.value).startswith("model.params.seq_len: no token of the 300 holdout rows counts: each was cut "
                                        f"to {recipe.params.seq_len} tokens before its assistant's turns")
    assert "trnflow data check SPEC" in str(raised.value)


def test_the_export_loads_with_transformers_and_generates_from_the_same_logits(tmp_path, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = _recipe()
    recipe.fit(prompts)
    torch.manual_seed(0)
    model = recipe.build_model().eval()
    assert recipe.export(model, tmp_path)
    lm = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    prompt = tokenizer("Review: great value\nSentiment:", return_tensors="pt")
    with torch.no_grad():
        theirs = lm(**prompt).logits[0, -1]
        ours = model.lm(**prompt).logits[0, -1]
        torch.testing.assert_close(theirs, ours)
        generated = lm.generate(**prompt, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 3)
    assert generated[0, -3] == theirs.argmax()  # greedy: the first new token is the trained logits' best


def test_a_pretrained_model_without_a_tokenizer_needs_room_for_the_one_trained(tmp_path, decoder_folder):
    import shutil

    from trnflow.errors import FatalError

    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(decoder_folder / name, folder / name)
    with pytest.raises(FatalError, match=r"model\.params\.vocab_size: 2048 is more than the pretrained model.s \d+ "
                                         "token embeddings"):
        _recipe(pretrained=str(folder), vocab_size=2048).build_model()


def test_the_config_cannot_disagree_with_the_tokenizer():
    from trnflow.specs import SpecError

    for config, said in (({"vocab_size": 260}, "config: vocab_size cannot be set here"),
                         ({"max_position_embeddings": 16}, "max_position_embeddings 16 is less than seq_len 32")):
        with pytest.raises(SpecError) as bad:
            _recipe(config={**SMALL["config"], **config})
        assert any(said in p for p in bad.value.problems), bad.value.problems


def test_a_saved_tokenizer_naming_special_tokens_it_lacks_is_refused(prompts):
    import json

    from trnflow.errors import FatalError

    recipe = _recipe()
    recipe.fit(prompts)
    document = json.loads(recipe.state())
    document["special"]["mask_token"] = "<brand-new>"  # would grow the vocabulary past the embeddings
    with pytest.raises(FatalError, match=r"step-20: names special tokens \['<brand-new>'\]"):
        _recipe().load(json.dumps(document).encode(), "step-20")


def _ranks(rank: int, port: int, features: torch.Tensor, out: Path) -> None:
    """One of two DDP ranks training on its half of a batch whose halves count unequal tokens."""
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    recipe = _recipe()
    torch.manual_seed(0)
    model = DDP(recipe.build_model())
    mine = features[rank::2]
    loss = recipe.loss(model(mine), torch.zeros(len(mine), dtype=torch.long))
    loss.backward()
    if rank == 0:
        torch.save({"grads": {k: p.grad for k, p in model.module.named_parameters()}, "loss": loss.detach()}, out)
    dist.destroy_process_group()


@pytest.mark.slow  # two real processes: `make test` runs it, `make test-fast` leaves it out
def test_ranks_counting_unequal_tokens_train_on_the_mean_over_all_of_them(prompts, tmp_path):
    """Rank 0's rows count far more tokens than rank 1's: the gradients DDP averages are those of the
    mean loss over every counted token of the batch, as one process computes it."""
    import socket

    recipe = _recipe(rows="text")
    recipe.fit(prompts)
    texts = ["a long review " * 6, "ok", "another long review text " * 3, "fine"]
    features = recipe.features(pa.table({"text": texts}))
    counts = features[:, 2].sum(1)
    assert counts[0::2].sum() > 3 * counts[1::2].sum()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_ranks, args=(port, features, tmp_path / "grads.pt"), nprocs=2, join=True)
    torch.manual_seed(0)
    whole = recipe.build_model()
    loss = recipe.loss(whole(torch.cat([features[0::2], features[1::2]])), torch.zeros(4, dtype=torch.long))
    loss.backward()
    ddp = torch.load(tmp_path / "grads.pt", weights_only=True)
    torch.testing.assert_close(ddp["loss"], loss.detach(), rtol=1e-5, atol=1e-6)  # rank 0 logs the batch's mean
    for name, parameter in whole.named_parameters():
        torch.testing.assert_close(ddp["grads"][name], parameter.grad, rtol=1e-4, atol=1e-6)


def test_its_blocks_are_the_decoder_layers_and_its_activations_are_counted():
    """Sharded training gathers one decoder layer at a time; the memory check counts the head's
    logits over the vocabulary, which dominate a small decoder's activations."""
    recipe = _recipe()
    model = recipe.build_model()
    assert recipe.blocks(model) == list(model.lm.model.layers) and len(recipe.blocks(model)) == 1
    logits = 4 * 32 * 300 * (4 + 8)  # batch 4, seq 32, vocab 300: the head's output, its fp32 copy, log-softmax
    assert logits < recipe.activation_bytes(4, 4) < 2 * logits
