"""Pretrained folders: a folder's own tokenizer is the featurizer (its token ids, its pad token),
saved beside checkpoints as a document that is read back without naming any code; nothing in a
folder runs, and weights come from safetensors only."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from tests.conftest import quickstart_data
from tests.pretrained import tiny_encoder
from trnflow.errors import FatalError
from trnflow.specs import validate_spec
from trnflow.testing.recipe_contract import RecipeContract
from trnflow.workload.recipes import RECIPES, recipe_for
from trnflow.workload.recipes.hf_pretrained import STATE_FORMAT, saved_state

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # transformers, and its models compiled: with the integration tests


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory, reviews) -> Path:
    return tiny_encoder(tmp_path_factory.mktemp("pretrained") / "encoder", reviews.column("text").to_pylist())


def _encoder(folder: Path, **params):
    return recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": {
        "pretrained": str(folder), "seq_len": 12, **params}})))


class TestHfEncoderFromAPretrainedFolder(RecipeContract):
    """hf-encoder with a pretrained folder's tokenizer keeps the recipe contract."""

    recipe = "hf-encoder"

    @pytest.fixture(autouse=True)
    def _folder(self, reviews, encoder_folder):
        self._table, self.params = reviews, {"pretrained": str(encoder_folder), "seq_len": 12}

    def rows(self) -> pa.Table:
        return self._table


def test_the_token_ids_are_the_pretrained_tokenizers_and_its_pad_token_is_masked(encoder_folder, reviews):
    import torch
    from transformers import AutoTokenizer

    recipe = _encoder(encoder_folder, seq_len=40)
    recipe.fit(reviews)
    texts = reviews.column("text").to_pylist()[:8]
    theirs = AutoTokenizer.from_pretrained(encoder_folder, local_files_only=True)(
        texts, padding="max_length", truncation=True, max_length=40, return_tensors="pt")
    ids = recipe.features(reviews.slice(0, 8))
    assert torch.equal(ids, theirs["input_ids"])
    assert recipe.pad_id == 3 and (ids == 3).any()  # the folder's [PAD], not trnflow's id 0
    model = recipe.build_model()
    assert model.pad_id == 3
    # a padded row embeds as its unpadded tokens do: the pad token is masked, not read
    short = ids[0][theirs["attention_mask"][0].bool()]
    padded = torch.full((1, 56), 3)
    padded[0, :len(short)] = short
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model.embed(ids[:1]), model.embed(padded), atol=1e-6)

    saved = recipe.state()
    document = saved_state(saved)
    assert document is not None and document["format"] == STATE_FORMAT
    assert set(document) == {"format", "tokenizer", "special", "chat_template"}
    assert document["special"]["pad_token"] == "[PAD]"
    again = _encoder(encoder_folder, seq_len=40)
    again.load(saved, "step-20")
    assert torch.equal(again.features(reviews.slice(0, 8)), ids)


def test_a_folder_without_a_tokenizer_keeps_the_trained_byte_pair_encoding(tmp_path, encoder_folder, reviews):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((encoder_folder / name).read_bytes())
    recipe = _encoder(folder, vocab_size=256)
    recipe.fit(reviews)
    assert saved_state(recipe.state()) is None and recipe.pad_id == 0
    assert json.loads(recipe.state())["model"]["type"] == "BPE"


def test_a_saved_tokenizer_is_read_from_its_definition_alone(encoder_folder, reviews):
    recipe = _encoder(encoder_folder)
    recipe.fit(reviews)
    document = json.loads(recipe.state())
    for damaged, message in (({**document, "special": {"tokenizer_class": "Evil"}}, "a damaged pretrained tokenizer"),
                             ({**document, "special": {"pad_token": ["x"]}}, "a damaged pretrained tokenizer"),
                             ({**document, "tokenizer": "{}"}, "not a tokenizer")):
        with pytest.raises(FatalError, match=f"step-20: {message}"):
            _encoder(encoder_folder).load(json.dumps(damaged).encode(), "step-20")
    bpe = _encoder(encoder_folder)  # a checkpoint made with trnflow's own tokenizer pads with 0
    plain = recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": {"vocab_size": 256,
                                                                                                 "seq_len": 12}})))
    plain.fit(reviews)
    with pytest.raises(FatalError, match=r"old-run: its tokenizer pads with id 0, the model with 3"):
        bpe.load(plain.state(), "old-run")


def test_nothing_in_a_pretrained_folder_runs_and_weights_come_from_safetensors_only(tmp_path, encoder_folder):
    import shutil

    folder = tmp_path / "named-code"
    shutil.copytree(encoder_folder, folder)
    ran = tmp_path / "ran"
    (folder / "custom.py").write_text(f"open({str(ran)!r}, 'w').close()\nfrom transformers import BertModel, "
                                      "PreTrainedTokenizerFast\nclass Model(BertModel): pass\n"
                                      "class Tok(PreTrainedTokenizerFast): pass\n")
    for name, auto in (("config.json", {"AutoModel": "custom.Model"}),
                       ("tokenizer_config.json", {"AutoTokenizer": [None, "custom.Tok"]})):
        document = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**document, "auto_map": auto}))
    recipe = _encoder(folder)
    assert type(recipe.build_model().encoder).__name__ == "BertModel" and recipe.pad_id == 3
    assert not ran.exists()

    pickled = tmp_path / "pickled"
    shutil.copytree(encoder_folder, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(FatalError, match=r"has no model\.safetensors; trnflow loads weights from safetensors only"):
        _encoder(pickled).build_model()


def test_no_kernel_hub_rewrites_a_pretrained_model(encoder_folder, monkeypatch):
    """transformers 5.25 with `kernels` installed swaps a loaded model's layers for hub kernels unless
    told not to (on the xla device it raised "Unsupported device type 'xla'"): trnflow's models stay
    as their folder defines them, whatever the environment says."""
    import transformers.modeling_utils as modeling

    monkeypatch.delenv("USE_HUB_KERNELS", raising=False)
    kernelized = []
    monkeypatch.setattr(modeling, "kernelize", lambda model, **_: kernelized.append(type(model).__name__))
    model = _encoder(encoder_folder).build_model()
    assert not kernelized and not model.encoder.use_kernels


def test_the_memory_estimate_counts_a_pretrained_models_parameters_without_loading_them(encoder_folder):
    """On the meta device the folder's config builds the architecture (from_pretrained refuses meta)."""
    from trnflow.workload.memory import parameter_count

    recipe = _encoder(encoder_folder)
    assert parameter_count(recipe) == sum(p.numel() for p in recipe.build_model().parameters())


def test_a_folder_that_steers_transformers_to_a_pickle_is_refused_before_anything_is_read(tmp_path, encoder_folder,
                                                                                         monkeypatch):
    """transformers reads a pickle despite use_safetensors when config.json names other weights or a
    safetensors index maps weights to .bin shards: both are refused, and torch.load never runs."""
    import shutil

    import torch

    calls = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or {})
    named = tmp_path / "named"
    shutil.copytree(encoder_folder, named)
    (named / "adapter_model.bin").write_bytes(b"pickle")
    config = json.loads((named / "config.json").read_text())
    (named / "config.json").write_text(json.dumps({**config, "transformers_weights": "adapter_model.bin"}))
    with pytest.raises(FatalError, match=r"names weights 'adapter_model.bin' in config.json"):
        _encoder(named).build_model()
    indexed = tmp_path / "indexed"
    shutil.copytree(encoder_folder, indexed)
    (indexed / "model.safetensors").rename(indexed / "dummy.safetensors")
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "pytorch_model-1.bin"}}))
    with pytest.raises(FatalError, match=r"has a weight index naming \['pytorch_model-1.bin'\]"):
        _encoder(indexed).build_model()
    assert calls == []


def test_a_layout_the_checks_miss_still_cannot_read_a_pickle(tmp_path, encoder_folder, monkeypatch):
    """Were the layout checks to miss a route to a pickle, the folder is still refused, naming the
    file, before transformers reads anything: whatever its name, a file that starts as a pickle, a
    zip (torch.save's format) or a NumPy array is one nothing may read. No global is patched, so a
    thread loading a checkpoint meanwhile is not affected."""
    import shutil

    import numpy as np
    import torch

    from trnflow.workload.recipes import hf_pretrained

    calls = []
    monkeypatch.setattr(hf_pretrained, "_weight_files", lambda folder: [])  # as if the checks had missed it
    for name, write in [("adapter_model.bin", lambda p: torch.save({"x": torch.zeros(1)}, p)),
                        ("weights.data", lambda p: torch.save({"x": torch.zeros(1)}, p)),
                        ("extra/state", lambda p: p.write_bytes(b"\x80\x04\x95" + b"\x00" * 8)),
                        ("table.txt", lambda p: np.save(p.open("wb"), np.array([object()], dtype=object),
                                                        allow_pickle=True))]:
        folder = tmp_path / name.replace("/", "-")
        shutil.copytree(encoder_folder, folder)
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write(folder / name)
        monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(a) or {})
        with pytest.raises(FatalError, match=rf"holds a file that could be unpickled \({name}\)"):
            _encoder(folder).build_model()
        monkeypatch.undo()
        monkeypatch.setattr(hf_pretrained, "_weight_files", lambda folder: [])
    assert calls == []
    assert hf_pretrained._pickles(encoder_folder) == []  # the safetensors, config and tokenizer are none


def test_a_relative_pretrained_folder_is_made_absolute_in_the_spec_every_job_reads(tmp_path, monkeypatch,
                                                                                  encoder_folder):
    monkeypatch.chdir(tmp_path)
    spec = validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": {"pretrained": "models/base"}}),
                         model=RECIPES)
    assert spec.model.params["pretrained"] == str(tmp_path / "models" / "base")
    again = validate_spec(json.loads(spec.model_dump_json()), model=RECIPES)  # as a job reads its spec.json
    assert again.model.params == spec.model.params
