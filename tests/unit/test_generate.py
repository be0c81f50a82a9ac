"""Generation in batch inference (`inference.generate`): greedy decoding equals transformers'
`generate`, a row stops at its end token, sampled completions depend on the seed and the row's id
alone, prompts end where each row's completion or last assistant turn begins, and a recipe that
does not generate is refused in the spec."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch

from tests.conftest import quickstart_data
from trnflow.specs import GenerateSpec, SpecError, validate_spec
from trnflow.workload.generate import generate
from trnflow.workload.memory import decided
from trnflow.workload.programs import programs_of
from trnflow.workload.recipes import recipe_for

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers: about 15 s

CONFIG = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 1}
ROWS = pa.table({"prompt": ["Review: great product, works well\nSentiment:", "Review: bad\nSentiment:"],
                 "completion": [" positive", " negative"]})


def _spec(rows: str = "prompt-completion", **generate):
    return validate_spec(quickstart_data(
        model={"recipe": "hf-causal-lm", "params": {"rows": rows, "seq_len": 48, "vocab_size": 300, "config": CONFIG}},
        gate={"metric": "perplexity", "metrics": []}, inference={"generate": {"max_new_tokens": 6, **generate}}))


@pytest.fixture(scope="module")
def lm():
    spec = _spec()
    recipe = recipe_for(spec)
    recipe.fit(ROWS)
    torch.manual_seed(0)
    return spec, recipe, recipe.build_model().eval()


def test_greedy_generation_is_transformers_own_from_each_rows_prompt(lm):
    spec, recipe, model = lm
    features = recipe.features(ROWS)
    buffer, lengths = recipe.prompts(features, 6)
    assert recipe.decode([buffer[i, :lengths[i]].tolist() for i in range(2)]) == ROWS.column("prompt").to_pylist()
    assert buffer.shape == (2, 48 + 6) and (buffer[0, lengths[0]:] == recipe.tokenizer.pad_id).all()
    with torch.no_grad():
        ours = generate(model.next_logits, recipe, features, ["a", "b"], spec.inference.generate)
        for i in range(2):
            theirs = model.lm.generate(input_ids=buffer[i:i + 1, :lengths[i]], max_new_tokens=6, do_sample=False,
                                       pad_token_id=recipe.tokenizer.pad_id, eos_token_id=None)
            assert ours[i] == theirs[0, lengths[i]:].tolist()[:len(ours[i])]
    assert "generate_step" in programs_of(decided(spec))
    unfitted = recipe_for(spec)  # the compile stage's trial: made-up rows, before any tokenizer is fitted
    made_up, at = unfitted.prompts(unfitted.example(4, torch.Generator().manual_seed(0)), 6)
    assert made_up.shape == (4, 48 + 6) and (at <= 48).all()


def test_a_row_stops_at_its_end_token(lm):
    spec, recipe, _ = lm
    end = recipe.end_token
    calls = []

    def logits(ids, at):  # the first row says its end at once; the second never does
        calls.append(at.clone())
        out = torch.zeros(len(ids), 300)
        out[0, end] = 1.0
        out[1, 7] = 1.0
        return out

    tokens = generate(logits, recipe, recipe.features(ROWS), ["a", "b"], spec.inference.generate)
    assert tokens == [[end], [7] * 6]
    assert [int(c[0]) for c in calls] == [int(calls[0][0])] * 6  # the ended row stays where it was


def test_sampled_completions_depend_on_the_seed_and_the_rows_id_alone(lm):
    _, recipe, model = lm
    features = recipe.features(ROWS)
    sampled = GenerateSpec(max_new_tokens=6, temperature=1.5, seed=3)
    with torch.no_grad():
        first = generate(model.next_logits, recipe, features, ["a", "b"], sampled)
        swapped = generate(model.next_logits, recipe, features[[1, 0]], ["b", "a"], sampled)
        other = generate(model.next_logits, recipe, features, ["a", "b"], sampled.model_copy(update={"seed": 4}))
        top1 = generate(model.next_logits, recipe, features, ["a", "b"],
                        sampled.model_copy(update={"top_k": 1}))
        greedy = generate(model.next_logits, recipe, features, ["a", "b"], GenerateSpec(max_new_tokens=6))
    assert first == [swapped[1], swapped[0]] and first != other
    assert top1 == greedy  # drawing from the single most likely token is greedy


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
