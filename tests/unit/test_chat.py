"""Chat rows on hf-causal-lm (`rows: chat`): the recipe contract, rendering with the tokenizer's own
chat template or the default, only the assistant's tokens counting, the template kept in every
checkpoint and export, malformed turns refused naming the row, and rows longer than the model's
input counted by `trnflow data check`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from tests.pretrained import tiny_causal_lm
from trnflow.cli.app import app
from trnflow.errors import FatalError
from trnflow.specs import validate_spec
from trnflow.testing.recipe_contract import RecipeContract
from trnflow.workload.recipes import recipe_for
from trnflow.workload.synth import chat, synthesize

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers: about 20 s

SMALL = {"config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                    "num_key_value_heads": 1, "tie_word_embeddings": True}, "vocab_size": 300, "seq_len": 160,
         "rows": "chat"}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chats(reviews) -> pa.Table:
    return pa.Table.from_pylist([chat(row, n) for n, row in enumerate(reviews.to_pylist())])


@pytest.fixture(scope="module")
def chatml_folder(tmp_path_factory, chats) -> Path:
    """A decoder whose tokenizer has a ChatML template of its own, its markers special tokens."""
    from transformers import AutoTokenizer

    texts = [t["content"] for row in chats.column("messages").to_pylist() for t in row]
    folder = tiny_causal_lm(tmp_path_factory.mktemp("pretrained") / "decoder", texts)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert len(tokenizer) <= config["vocab_size"] + 2
    config["vocab_size"] = len(tokenizer)  # room for the two markers (their embeddings: see below)
    (folder / "config.json").write_text(json.dumps(config))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True)
    model.save_pretrained(folder)
    return folder


def _recipe(**params):
    return recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-causal-lm", "params": {**SMALL, **params}},
                                                    gate={"metric": "perplexity", "metrics": []})))


class TestHfCausalLmOnChats(RecipeContract):
    recipe = "hf-causal-lm"
    params: ClassVar[dict] = SMALL

    @pytest.fixture(autouse=True)
    def _rows(self, chats):
        self._table = chats

    def rows(self) -> pa.Table:
        return self._table


def _counted(recipe, rows: pa.Table) -> list[str]:
    features = recipe.features(rows)
    tok = recipe.tokenizer.tokenizer
    return [tok.decode(f[0][f[2].bool()].tolist()) for f in features]


def test_the_default_template_renders_turns_and_only_the_assistants_count(chats):
    recipe = _recipe(seq_len=256)
    recipe.fit(chats)
    rows = chats.slice(0, 3)  # the third has a second exchange
    features = recipe.features(rows)
    tok = recipe.tokenizer.tokenizer
    whole = tok.decode(features[2, 0][features[2, 1].bool()].tolist())
    review = rows.column("messages")[2].as_py()[1]["content"]
    word = rows.column("messages")[2].as_py()[2]["content"]
    assert whole == (f"<s>system: Say whether the customer's review is positive or negative, in one word.\n"
                     f"user: {review}\nassistant: {word}</s>\nuser: Are you sure?\nassistant: Yes: the review is "
                     f"{word}.</s>")
    assert _counted(recipe, rows)[2] == f" {word}</s> Yes: the review is {word}.</s>"
    assert _counted(recipe, rows.slice(0, 1))[0] == f" {rows.column('messages')[0].as_py()[2]['content']}</s>"


def test_a_tokenizers_own_template_renders_the_chats_and_travels_with_checkpoints_and_exports(chatml_folder, chats,
                                                                                                tmp_path):
    from transformers import AutoTokenizer

    recipe = _recipe(pretrained=str(chatml_folder), seq_len=256)
    recipe.fit(chats)
    rows = chats.slice(0, 1)
    turn = rows.column("messages")[0].as_py()
    assert _counted(recipe, rows) == [f"{turn[2]['content']}<|im_end|>\n"]
    theirs = AutoTokenizer.from_pretrained(chatml_folder)
    ids = theirs.apply_chat_template(turn, tokenize=True, return_dict=False)
    assert recipe.features(rows)[0, 0, :len(ids)].tolist() == list(ids)

    again = _recipe(pretrained=str(chatml_folder), seq_len=256)
    again.load(recipe.state(), "a checkpoint")
    assert again.tokenizer.own_template == CHATML
    assert again.features(rows).equal(recipe.features(rows))

    plain = _recipe(seq_len=256)  # the default template, saved with the export
    plain.fit(chats)
    plain.tokenizer.save(tmp_path)
    exported = AutoTokenizer.from_pretrained(tmp_path)
    rendered = exported.apply_chat_template(turn, tokenize=True, return_dict=False)
    assert plain.features(rows)[0, 0, :len(rendered)].tolist() == list(rendered)


def test_a_malformed_chat_is_refused_naming_its_row(chats):
    recipe = _recipe()
    recipe.fit(chats)
    for bad, why in (([], "is not a list of turns"), (None, "is not a list of turns"),
                     ([{"role": "robot", "content": "hi"}], "turn 0"), ([{"role": "user", "content": 3}], "turn 0")):
        with pytest.raises(FatalError, match=f"messages of row 1: {why}"):
            recipe.chat(bad, 1)
    rows = pa.table({"messages": [[{"role": "user", "content": "hi"}], None]})
    with pytest.raises(FatalError, match="messages of row 1: is not a list of turns"):
        recipe.features(rows)


def test_data_check_counts_the_chats_longer_than_the_model_reads(chatml_folder, tmp_path, monkeypatch):
    synthesize(tmp_path / "data", days=1, rows_per_day=30, seed=1, fmt="chat", holdout_rows=12, inference_rows=9)
    first = json.loads((tmp_path / "data" / "train" / "dt=2026-01-01" / "part-00000.jsonl").read_text().splitlines()[2])
    assert [t["role"] for t in first["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    folder = tmp_path / "base"
    shutil.copytree(chatml_folder, folder)
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(quickstart_data(
        name="chats", model={"recipe": "hf-causal-lm", "params": {"pretrained": str(folder), "rows": "chat",
                                                                  "seq_len": 40}},
        data={"train": str(tmp_path / "data" / "train"), "holdout": str(tmp_path / "data" / "holdout"),
              "inference": str(tmp_path / "data" / "inference"), "format": "jsonl"},
        gate={"metric": "perplexity", "metrics": []})))
    result = CliRunner().invoke(app, ["data", "check", str(spec), "--json"])
    assert result.exit_code == 0, result.output
    parts = json.loads(result.stdout)["parts"]
    cut = {p["field"]: sum(f["rows_cut"] for f in p["files"]) for p in parts}
    assert 0 < cut["data.train"] <= 30 and 0 < cut["data.holdout"] <= 12
    assert any("longer than the model's input" in n for p in parts for n in p["notes"])
    longer = json.loads(CliRunner().invoke(app, ["data", "check", str(spec), "--json", "--set",
                                                 "model.params.seq_len=512"]).stdout)["parts"]
    assert all(f["rows_cut"] == 0 for p in longer for f in p["files"])
    packed = CliRunner().invoke(app, ["data", "check", str(spec), "--set", "model.params.seq_len=512", "--set",
                                      "data.packing=true", "--json"])
    parts = {p["field"]: p for p in json.loads(packed.stdout)["parts"]}
    assert parts["data.holdout"]["packing"] is None and parts["data.inference"]["packing"] is None  # training's
    train = parts["data.train"]["packing"]
    assert train["rows"] == 30 and 0 < train["windows"] < 30 and train["seq_len"] == 512
    assert any(n.startswith(f"data.packing: 30 rows packed into {train['windows']} windows of 512 tokens, ")
               for n in parts["data.train"]["notes"])
