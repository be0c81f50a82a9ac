"""Generation in batch inference (`inference.generate`): greedy decoding equals transformers'
`generate`, with the cache of keys and values and without it; a row stops at its end token,
sampled completions depend on the seed and the row's id alone, prompts end where each row's
completion or last assistant turn begins, and a recipe or decoder that cannot generate so is
refused in the spec."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from tests.conftest import quickstart_data
from trnflow.specs import GenerateSpec, SpecError, validate_spec
from trnflow.workload.generate import Caching, Recomputing, end_aligned, generate
from trnflow.workload.memory import decided
from trnflow.workload.programs import programs_of
from trnflow.workload.recipes import model_problems, recipe_for

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers: about 15 s

CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1}
GPT2 = {"n_embd": 16, "n_layer": 2, "n_head": 2}
ROWS = pa.table({"prompt": ["Review: great product, works well\nSentiment:", "Review: bad\nSentiment:", "So"],
                 "completion": [" positive", " negative", " what"]})
IDS = ["a", "b", "c"]


def _spec(rows: str = "prompt-completion", model_type: str = "llama", config: dict = CONFIG, **generate):
    return validate_spec(quickstart_data(
        model={"recipe": "hf-causal-lm", "params": {"rows": rows, "seq_len": 48, "vocab_size": 300,
                                                    "model_type": model_type, "config": config}},
        gate={"metric": "perplexity", "metrics": []}, inference={"generate": {"max_new_tokens": 12, **generate}}))


def _lm(model_type: str = "llama", config: dict = CONFIG):
    spec = _spec(model_type=model_type, config=config)
    recipe = recipe_for(spec)
    recipe.fit(ROWS)
    torch.manual_seed(0)
    return spec, recipe, recipe.build_model().eval()


@pytest.fixture(scope="module")
def lm():
    return _lm()


def cached(model):
    """Generation through the model's prefill and decode, as `Programs.decoding` runs them compiled."""
    def decode_next(tokens, slot, starts, cache):
        return model.decode_next(tokens, torch.tensor(slot), starts, cache)

    return Caching(model.prefill, decode_next)


@pytest.mark.parametrize("model_type, config", [("llama", CONFIG), ("gpt2", GPT2)], ids=["llama", "gpt2"])
def test_greedy_generation_is_transformers_own_with_the_cache_and_without(model_type, config):
    spec, recipe, model = _lm(model_type, config)
    features = recipe.features(ROWS)
    buffer, lengths = recipe.prompts(features, 12)
    assert recipe.decode([buffer[i, :lengths[i]].tolist() for i in range(3)]) == ROWS.column("prompt").to_pylist()
    assert buffer.shape == (3, 48 + 12) and (buffer[0, lengths[0]:] == recipe.tokenizer.pad_id).all()
    settings = spec.inference.generate
    with torch.no_grad():
        ours = generate(Recomputing(model.next_logits), recipe, features, IDS, settings)
        with_cache = generate(cached(model), recipe, features, IDS, settings)
        for i in range(3):
            theirs = model.lm.generate(input_ids=buffer[i:i + 1, :lengths[i]], max_new_tokens=12, do_sample=False,
                                       pad_token_id=recipe.tokenizer.pad_id, eos_token_id=None)
            assert ours[i] == theirs[0, lengths[i]:].tolist()[:len(ours[i])]
    assert with_cache == ours and any(len(row) > 4 for row in ours)
    assert programs_of(decided(spec))[-2:] == ("prefill_step", "decode_step")
    no_cache = _spec(kv_cache=False)
    assert programs_of(decided(no_cache))[-1] == "generate_step" and "decode_step" not in programs_of(decided(no_cache))
    unfitted = recipe_for(spec)  # the compile stage's trial: made-up rows, before any tokenizer is fitted
    made_up, at = unfitted.prompts(unfitted.example(4, torch.Generator().manual_seed(0)), 12)
    assert made_up.shape == (4, 48 + 12) and (at <= 48).all()


def test_the_cache_holds_each_rows_prompt_ending_together_and_one_slot_a_token(lm):
    _, recipe, model = lm
    buffer, lengths = recipe.prompts(recipe.features(ROWS), 12)
    prompts, starts = end_aligned(buffer, lengths, 48)
    assert (starts == 48 - lengths).all()
    for i in range(3):
        assert prompts[i, starts[i]:].tolist() == buffer[i, :lengths[i]].tolist()
    with torch.no_grad():
        logits, cache = model.prefill(prompts, starts, 12)
        # layers, keys and values, rows, key-value heads, seq_len + max_new_tokens, head size
        assert cache.shape == (2, 2, 3, 1, 60, 8) and (cache[..., 48:, :] == 0).all()
        after, written = model.decode_next(logits.argmax(-1), torch.tensor(48), starts, cache)
    assert torch.equal(written[..., :48, :], cache[..., :48, :]) and (written[..., 48, :] != 0).any()
    assert (written[..., 49:, :] == 0).all() and after.shape == logits.shape == (3, 300)


def test_a_row_stops_at_its_end_token(lm):
    spec, recipe, _ = lm
    end = recipe.end_token
    calls = []

    def logits(ids, at):  # the first row says its end at once; the others never do
        calls.append(at.clone())
        out = torch.zeros(len(ids), 300)
        out[0, end] = 1.0
        out[1:, 7] = 1.0
        return out

    tokens = generate(Recomputing(logits), recipe, recipe.features(ROWS), IDS, spec.inference.generate)
    assert tokens == [[end], [7] * 12, [7] * 12]
    assert [int(c[0]) for c in calls] == [int(calls[0][0])] * 12  # the ended row stays where it was


def test_sampled_completions_depend_on_the_seed_and_the_rows_id_alone(lm):
    _, recipe, model = lm
    features = recipe.features(ROWS)
    sampled = GenerateSpec(max_new_tokens=6, temperature=1.5, seed=3)
    recomputing = Recomputing(model.next_logits)
    with torch.no_grad():
        first = generate(recomputing, recipe, features, IDS, sampled)
        swapped = generate(recomputing, recipe, features[[1, 0, 2]], ["b", "a", "c"], sampled)
        other = generate(recomputing, recipe, features, IDS, sampled.model_copy(update={"seed": 4}))
        top1 = generate(recomputing, recipe, features, IDS, sampled.model_copy(update={"top_k": 1}))
        greedy = generate(recomputing, recipe, features, IDS, GenerateSpec(max_new_tokens=6))
        with_cache = generate(cached(model), recipe, features, IDS, sampled)
    assert first == [swapped[1], swapped[0], swapped[2]] and first != other
    assert top1 == greedy  # drawing from the single most likely token is greedy
    assert with_cache == first  # the same draws from the same probabilities


def test_a_chats_prompt_ends_with_the_generation_prompt_of_its_last_assistant_turn():
    spec = _spec("chat")
    recipe = recipe_for(spec)
    chat = [{"role": "user", "content": "great product"}, {"role": "assistant", "content": "positive"},
            {"role": "user", "content": "sure?"}, {"role": "assistant", "content": "yes"}]
    rows = pa.table({"messages": [chat]})
    recipe.fit(rows)
    buffer, lengths = recipe.prompts(recipe.features(rows), 4)
    assert recipe.tokenizer.tokenizer.decode(buffer[0, :lengths[0]].tolist()) == (
        "<s>user: great product\nassistant: positive</s>\nuser: sure?\nassistant:")


def test_a_recipe_that_does_not_generate_is_refused():
    with pytest.raises(SpecError, match=r"inference\.generate: recipe m5-text does not generate text"):
        recipe_for(validate_spec(quickstart_data(inference={"generate": {}})))


def test_a_decoder_that_does_not_take_positions_as_given_generates_without_the_cache():
    opt = quickstart_data(model={"recipe": "hf-causal-lm", "params": {"model_type": "opt", "config": {}}},
                          gate={"metric": "perplexity", "metrics": []}, inference={"generate": {}})
    assert model_problems(opt) == [
        "inference.generate.kv_cache: model_type opt does not take positions and an attention mask as given (the "
        "llama, qwen2, qwen3 and gpt2 decoders do), which generating with a cache needs; set "
        "inference.generate.kv_cache: false"]
    opt["inference"]["generate"]["kv_cache"] = False
    assert model_problems(opt) == []


def test_a_decoders_right_padding_raises_no_attention_mask_warning_and_other_messages_pass():
    """GPT-2 given right-padded ids and no mask logs transformers' "We strongly recommend passing in
    an `attention_mask`" (once per process): a causal model here drops it, and only it, from
    transformers' log: right padding is never attended to by a real token."""
    import logging

    _lm("gpt2", GPT2)  # builds the CausalLanguageModel, which quiets the message
    logger = logging.getLogger("transformers.modeling_utils")
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logger.addHandler(handler)
    try:
        logger.warning("We strongly recommend passing in an `attention_mask` since your input_ids may be padded.")
        logger.warning("some other message")
    finally:
        logger.removeHandler(handler)
    assert heard == ["some other message"]
