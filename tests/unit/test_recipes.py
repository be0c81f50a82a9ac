"""Recipes: the built-in m5-text keeps the recipe contract, recipes are found by name or by import
path, a spec's params are checked against its recipe's, and a spec in the form from before recipes
is told how to write it now."""

from __future__ import annotations

import sys
from typing import ClassVar

import pyarrow as pa
import pytest

from tests.conftest import quickstart_data
from trnflow.errors import FatalError
from trnflow.specs import SpecError, validate_spec
from trnflow.testing.recipe_contract import RecipeContract
from trnflow.workload.recipes import RECIPES, installed, recipe_class, recipe_for
from trnflow.workload.recipes.m5_text import M5Text


class TestM5Text(RecipeContract):
    recipe = "m5-text"
    params: ClassVar[dict] = {"vocab_size": 300, "d_model": 16, "n_heads": 2, "n_layers": 1, "ffn_dim": 32,
                              "mlp_hidden": [8], "seq_len": 12}

    @pytest.fixture(autouse=True)
    def _rows(self, reviews):
        self._table = reviews

    def rows(self) -> pa.Table:
        return self._table


def test_recipes_are_found_by_name_or_import_path_and_a_wrong_one_says_what_is_installed(monkeypatch):
    monkeypatch.setenv("TRNFLOW_RECIPE_MODULES", "1")  # modules by name: allowed here
    assert installed()["m5-text"] == "trnflow.workload.recipes.m5_text:M5Text"
    assert installed()["hf-encoder"] == "trnflow.workload.recipes.hf_encoder:HfEncoder"
    assert recipe_class("m5-text") is M5Text is recipe_class("trnflow.workload.recipes.m5_text:M5Text")
    installed_ones = r"\(installed: hf-causal-lm, hf-encoder, m5-text, tabular-mlp\)"
    with pytest.raises(FatalError, match=rf"'m6-text' is not an installed recipe {installed_ones}"):
        recipe_class("m6-text")
    with pytest.raises(FatalError, match="cannot be loaded"):
        recipe_class("no_such_package.recipes:Thing")
    with pytest.raises(FatalError, match="not a trnflow Recipe subclass"):
        recipe_class("trnflow.workload.recipes.m5_text.params:M5TextParams")


def test_params_are_checked_against_the_recipe_and_named_under_model_params():
    spec = validate_spec(quickstart_data(model={"params": {"d_model": 32}}), model=RECIPES)
    assert recipe_for(spec).params.d_model == 32 and recipe_for(spec).params.vocab_size == 4096
    with pytest.raises(SpecError) as bad:
        validate_spec(quickstart_data(model={"params": {"d_model": 30, "n_heads": 4, "depth": 3}}), model=RECIPES)
    assert "model.params.depth: Extra inputs are not permitted" in bad.value.problems
    with pytest.raises(SpecError) as bad:
        validate_spec(quickstart_data(model={"params": {"d_model": 30, "n_heads": 4}}), model=RECIPES)
    assert bad.value.problems == ["model.params.d_model: 30 is not divisible by n_heads (4); pick a width that is "
                                  "a multiple of the head count"]
    with pytest.raises(SpecError) as bad:
        validate_spec(quickstart_data(model={"recipe": "tabular-thing"}), model=RECIPES)
    assert bad.value.problems[0].startswith("model.recipe: 'tabular-thing' is not an installed recipe")


def test_a_spec_from_before_recipes_is_shown_its_new_form_with_its_own_values():
    data = quickstart_data()
    data["model"] = {"vocab_size": 5000, "d_model": 64, "recipe": "m5-text"}
    with pytest.raises(SpecError) as old:
        validate_spec(data)
    (problem,) = old.value.problems
    assert problem == ('model.params: vocab_size, d_model are the recipe\'s settings and go under model.params, with '
                       'model.recipe beside them; write  model: {"recipe": "m5-text", "params": '
                       '{"vocab_size": 5000, "d_model": 64}}')


def test_the_recipe_and_its_version_are_part_of_every_compile_key_and_plan():
    from trnflow.emulator.device import EmulatorDevice
    from trnflow.workload.memory import decided
    from trnflow.workload.recipes import plan_digest

    spec = decided(validate_spec(quickstart_data()))
    flags = EmulatorDevice().compiler(spec, mode="extract", model=recipe_for(spec).key).flags
    assert flags["model"] == "m5-text@1"
    wider = decided(validate_spec(quickstart_data(model={"params": {"d_model": 128}})))
    assert plan_digest(spec) != plan_digest(wider)
    split = spec.with_layout(spec.layout.model_copy(update={"strategy": "fsdp"}))
    assert plan_digest(split) != plan_digest(spec)  # a sharded model's programs are others


def test_a_recipe_without_embeddings_publishes_predictions_and_class_probabilities():
    import torch

    from trnflow.workload.infer import _shard_table

    logits = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    tabular, text = TestTabularMLP().make(), recipe_for(validate_spec(quickstart_data()))
    assert not tabular.embeds and text.embeds
    table = _shard_table(pa.array(["a", "b"]), logits, "run/step-2", tabular)
    assert table.column_names == ["id", "prediction", "probabilities", "model_version"]
    assert table.column("prediction").to_pylist() == [0, 1]
    probabilities = table.column("probabilities").to_pylist()
    assert all(abs(sum(p) - 1) < 1e-6 for p in probabilities) and probabilities[0][0] > 0.8
    embedded = _shard_table(pa.array(["a", "b"]), logits, "run/step-2", text)
    assert embedded.column_names == ["id", "embedding", "model_version"]
    assert embedded.column("embedding").to_pylist() == [[2.0, 0.0], [0.0, 3.0]]
    assert embedded.column("id").to_pylist() == ["a", "b"]


class TestTabularMLP(RecipeContract):
    """The example recipe in examples/recipes, installed as a package of its own (make install)."""

    recipe = "tabular-mlp"
    params: ClassVar[dict] = {"features": ["f0", "f1", "f2", "f3"], "hidden": [8]}

    def rows(self) -> pa.Table:
        import numpy as np
        from tabular_recipe.data import rows

        return rows(np.random.default_rng(0), 40, 0, labelled=True)


def test_the_external_recipe_is_installed_through_its_entry_point():
    assert installed()["tabular-mlp"] == "tabular_recipe:TabularMLP"
    assert recipe_class("tabular-mlp").embeds is False


@pytest.mark.slow  # transformers, and its model compiled: with the integration tests
class TestHfEncoder(RecipeContract):
    """The built-in Hugging Face encoder, built from a small BERT config (no download)."""

    recipe = "hf-encoder"
    params: ClassVar[dict] = {"vocab_size": 300, "seq_len": 12, "config": {
        "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}}

    @pytest.fixture(autouse=True)
    def _rows(self, reviews):
        self._table = reviews

    def rows(self) -> pa.Table:
        return self._table


@pytest.mark.slow  # transformers saves and loads a model: with the integration tests
def test_the_hugging_face_encoder_starts_from_a_local_save_pretrained_folder(tmp_path):
    """model.params.pretrained: the encoder's config and weights come from the folder (no download)."""
    import torch

    source = recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": TestHfEncoder.params})))
    torch.manual_seed(3)
    trained = source.build_model()
    trained.encoder.save_pretrained(tmp_path / "encoder")
    again = recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": {
        **TestHfEncoder.params, "pretrained": str(tmp_path / "encoder"), "config": {}}})))
    loaded = again.build_model().encoder.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in trained.encoder.state_dict().items())
    too_big = recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": {
        **TestHfEncoder.params, "pretrained": str(tmp_path / "encoder"), "vocab_size": 5000}})))
    with pytest.raises(FatalError, match=r"model\.params\.vocab_size: 5000 is more than the pretrained model.s 300"):
        too_big.build_model()
    with pytest.raises(FatalError, match=r"has no config\.json"):
        recipe_for(validate_spec(quickstart_data(model={"recipe": "hf-encoder", "params": {
            "pretrained": str(tmp_path)}}))).build_model()


def test_the_recipes_optimizer_is_the_one_the_memory_estimate_counts(make_spec):
    """AdamW keeps two values per weight; a recipe whose optimizer is SGD with momentum keeps one,
    and the estimate follows the hook rather than assuming AdamW."""
    import torch

    from trnflow.workload.memory import estimate, optimizer_moments
    from trnflow.workload.recipes import for_job

    spec = make_spec()
    recipe = for_job(spec)
    assert optimizer_moments(recipe, spec) == 2
    adamw = estimate(spec, recipe)
    assert adamw.optimizer == 2 * adamw.weights

    class WithMomentum(type(recipe)):
        def optimizer(self, parameters, train):
            return torch.optim.SGD(parameters, lr=train.lr, momentum=0.9)

    sgd = WithMomentum(recipe.params, recipe.data)
    assert optimizer_moments(sgd, spec) == 1
    assert estimate(spec, sgd).optimizer == adamw.weights


def test_the_recipe_written_out_in_the_docs_keeps_the_contract(reviews, tmp_path):
    """docs/recipes.md's whole recipe, as a reader copies it, through the contract suite."""
    import importlib.util
    import sys
    from pathlib import Path

    from tests.markdown import FENCE

    page = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    (code,) = [body for language, body in FENCE.findall(page) if language == "python" and "class LetterCounts" in body]
    (tmp_path / "letter_recipe.py").write_text(code)
    spec = importlib.util.spec_from_file_location("letter_recipe", tmp_path / "letter_recipe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["letter_recipe"] = module
    spec.loader.exec_module(module)

    class TestLetterCounts(RecipeContract):
        recipe = module.LetterCounts
        params: ClassVar[dict] = {"letters": 12}

        def rows(self) -> pa.Table:
            return reviews

    suite = TestLetterCounts()
    checks = [name for name in dir(RecipeContract) if name.startswith("test_")]
    assert len(checks) >= 9
    for name in checks:
        getattr(suite, name)()
    wide = module.LetterCounts(module.LetterParams(letters=500), suite.make().data)  # more than the text has
    wide.fit(reviews)
    assert wide.features(reviews.slice(0, 3)).shape == (3, 500)


POISON = """
from pathlib import Path
Path({marker!r}).write_text("ran")
"""


@pytest.fixture
def poison(tmp_path, monkeypatch):
    """A module on sys.path that leaves a file behind when it is imported; the file's path."""
    marker = tmp_path / "ran.txt"
    (tmp_path / "poison_recipe.py").write_text(POISON.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    return marker


def test_a_spec_names_no_module_unless_the_settings_allow_it(poison, monkeypatch):
    """A spec cannot make trnflow import a module: `module:attr` is refused, in one line, unless
    TRNFLOW_RECIPE_MODULES=1; with it, validation finds the module without running it."""
    monkeypatch.delenv("TRNFLOW_RECIPE_MODULES", raising=False)
    for ref in ("poison_recipe:Thing", "this:X"):
        with pytest.raises(SpecError) as refused:
            validate_spec(quickstart_data(model={"recipe": ref}), model=RECIPES)
        assert refused.value.problems == [
            f"model.recipe: {ref!r} names a module, and importing a module runs its code: trnflow takes recipes from "
            "installed packages (`trnflow recipes` lists them); install it with an entry point under trnflow.recipes, "
            "or set TRNFLOW_RECIPE_MODULES=1 where every spec is trusted"]
    assert not poison.exists() and "this" not in sys.modules
    monkeypatch.setenv("TRNFLOW_RECIPE_MODULES", "1")
    assert validate_spec(quickstart_data(model={"recipe": "poison_recipe:Thing"}), model=RECIPES).model.recipe == \
        "poison_recipe:Thing"
    assert not poison.exists()  # looked up, not imported
    with pytest.raises(SpecError, match=r"no module 'no_such_pkg\.sub' can be imported here"):
        validate_spec(quickstart_data(model={"recipe": "no_such_pkg.sub:Thing"}), model=RECIPES)
    # an installed recipe by its path is the installed recipe, allowed either way
    monkeypatch.delenv("TRNFLOW_RECIPE_MODULES")
    assert recipe_class("trnflow.workload.recipes.m5_text:M5Text") is M5Text


@pytest.mark.parametrize("ref", [".foo:X", ":X", "foo:", "foo:X:Y", "a b:X", "../x", ""])
def test_a_malformed_recipe_is_one_line_naming_the_field(ref):
    with pytest.raises(SpecError) as bad:
        validate_spec(quickstart_data(model={"recipe": ref}))
    assert len(bad.value.problems) == 1 and bad.value.problems[0].startswith("model.recipe: "), bad.value.problems
    assert "\n" not in bad.value.problems[0] and "Traceback" not in str(bad.value)
