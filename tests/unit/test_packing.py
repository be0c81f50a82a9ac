"""Sequence packing (data.packing): rows placed in order, windows that hold every token once, and a
model that counts the same tokens, with the same loss, as it does on the rows one by one."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import quickstart_data
from trnflow.specs import validate_spec
from trnflow.workload.features import featurize
from trnflow.workload.packing import one_per_window
from trnflow.workload.recipes import model_problems, recipe_for
from trnflow.workload.windows import FirstFit

pytestmark = pytest.mark.unit

SMALL = {"config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "tie_word_embeddings": True}, "vocab_size": 300, "seq_len": 160}
GPT2 = {"model_type": "gpt2", "vocab_size": 300, "seq_len": 160, "config": {"n_embd": 16, "n_layer": 1, "n_head": 2}}


def test_each_row_goes_into_the_first_open_window_with_room_and_windows_close_full_or_oldest():
    fit = FirstFit(10, open_windows=2)
    placed = [fit.place(n) for n in (4, 5, 2, 1, 7, 3, 8)]
    assert placed == [(0, 0), (0, 4), (1, 0), (0, 9), (1, 2), (2, 0), (3, 0)]
    assert fit.closed() == [0, 1]  # 0 filled; 1 the oldest open when a third opened
    assert fit.closed() == [] and fit.closed(everything=True) == [2, 3]
    fill = fit.fill()
    assert (fill.rows, fill.windows, fill.tokens) == (7, 4, 30) and fill.fill == 30 / 40
    assert fill.unpacked == 30 / 70  # one row a window
    assert str(fill) == "7 rows packed into 4 windows of 10 tokens, 75.0% of them real"
    with pytest.raises(ValueError, match="a row of 11 tokens cannot be packed into windows of 10"):
        fit.place(11)


def test_only_a_recipe_whose_rows_are_tokens_packs():
    spec = quickstart_data(data={"packing": True})  # m5-text
    assert model_problems(spec) == ["data.packing: recipe m5-text does not pack rows (hf-causal-lm does); remove it"]
    lm = quickstart_data(model={"recipe": "hf-causal-lm", "params": SMALL}, data={"packing": True},
                         gate={"metric": "perplexity", "metrics": []})
    assert model_problems(lm) == []
    opt = quickstart_data(model={"recipe": "hf-causal-lm", "params": {**SMALL, "model_type": "opt", "config": {}}},
                          data={"packing": "yes"}, gate={"metric": "perplexity", "metrics": []})
    assert model_problems(opt) == ["data.packing: model_type opt does not take positions and an attention mask as "
                                   "given (the llama, qwen2, qwen3 and gpt2 decoders do), which packed rows need; "
                                   "remove data.packing"]
    sliding = quickstart_data(model={"recipe": "hf-causal-lm", "params": {
        **SMALL, "model_type": "qwen2", "config": {**SMALL["config"], "use_sliding_window": True}}},
        data={"packing": True}, gate={"metric": "perplexity", "metrics": []})
    assert "masks a sliding window of its own" in model_problems(sliding)[0]


@pytest.mark.slow  # transformers
def test_each_row_of_a_packed_window_sees_only_itself_up_to_each_token():
    from trnflow.workload.recipes.hf_causal_lm import packed_mask

    positions = torch.tensor([[0, 1, 2, 0, 1, 5]])  # a row of 3, a row of 2, then padding (position 5)
    allowed = packed_mask(positions, "sdpa", torch.float32)[0, 0]
    assert allowed.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                      [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 1]]
    added = packed_mask(positions, "eager", torch.bfloat16)[0, 0]  # eager adds it to the scores
    assert added.dtype == torch.bfloat16 and (added == 0).equal(allowed)
    assert (added[~allowed] == torch.finfo(torch.bfloat16).min).all()


def _recipe(params: dict, rows: str = "prompt-completion", packing: bool = True):
    return recipe_for(validate_spec(quickstart_data(
        model={"recipe": "hf-causal-lm", "params": {**params, "rows": rows}}, data={"packing": packing},
        gate={"metric": "perplexity", "metrics": []})))


@pytest.mark.slow  # transformers
@pytest.mark.parametrize(("params", "rows"), [(SMALL, "prompt-completion"), (SMALL, "text"),
                                              (GPT2, "prompt-completion")], ids=["llama", "llama-text", "gpt2"])
def test_packed_windows_hold_every_token_once_and_the_model_counts_the_same_tokens_and_loss(prompts, params, rows):
    table = prompts  # the reviews' text too, for text rows
    recipe = _recipe(params, rows)
    recipe.fit(table)
    alone = recipe.features(table.select(recipe.columns()))
    halves = [table.slice(0, 5), table.slice(5)]  # streamed a batch at a time: packed across the batches
    packed = featurize(halves, recipe, label_field="label", pack=True)
    windows = packed.features[torch.arange(len(packed.features))]
    assert packed.packing is not None and packed.packing.rows == len(alone)
    assert len(windows) == packed.packing.windows < len(alone) and packed.labels.tolist() == [0] * len(windows)
    assert windows.shape[1:] == (4, recipe.params.seq_len)
    # every row once, whole (its tokens a run of positions from 0), counted as it was
    assert windows[:, 1].sum() == alone[:, 1].sum() and windows[:, 2].sum() == alone[:, 2].sum()
    runs = []
    for window in windows:
        starts = ((window[3] == 0) & (window[1] == 1)).nonzero().flatten().tolist()
        ends = [*starts[1:], int(window[1].sum())]
        runs += [(*window[0, a:b].tolist(), *window[2, a:b].tolist()) for a, b in zip(starts, ends, strict=True)]
    lengths = alone[:, 1].sum(1).tolist()
    rows = [(*r[0, :n].tolist(), *r[2, :n].tolist()) for r, n in zip(alone, lengths, strict=True)]
    assert sorted(runs) == sorted(rows)

    model = recipe.build_model().eval()
    with torch.no_grad():
        one_by_one, together = model(alone).double(), model(windows).double()
    assert together[:, 1].sum() == one_by_one[:, 1].sum() > 0  # the same tokens counted
    per_token = [scores[:, 0].sum().item() / scores[:, 1].sum().item() for scores in (one_by_one, together)]
    assert per_token[1] == pytest.approx(per_token[0], rel=1e-5, abs=1e-5)
    assert together[:, 2].sum() == one_by_one[:, 2].sum()  # and the same ones predicted right

    example = one_per_window(recipe.example(2, torch.Generator().manual_seed(0)))  # the trial run's shape
    assert example.shape == (2, 4, 160) and example[0, 3].tolist() == list(range(160))


@pytest.mark.slow  # transformers
def test_an_unpacked_spec_featurizes_one_row_a_row(prompts):
    recipe = _recipe(SMALL, packing=False)
    recipe.fit(prompts)
    rows = featurize([prompts], recipe, label_field="label")
    assert rows.packing is None and len(rows.features) == prompts.num_rows and rows.features.shape == (3, 160)


@pytest.mark.slow  # transformers
def test_the_data_check_reckons_the_fill_as_training_packs_it(prompts):
    recipe = _recipe(SMALL)
    recipe.fit(prompts)
    lengths = recipe.token_lengths(prompts)
    assert lengths is not None and len(lengths) == prompts.num_rows
    fit = FirstFit(160)
    for n in lengths:
        fit.place(min(n, 160))
    assert featurize([prompts], recipe, label_field="label", pack=True).packing == fit.fill()
