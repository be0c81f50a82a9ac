"""The contract every recipe keeps, as a pytest suite a recipe author runs against their own recipe.

    from trnflow.testing.recipe_contract import RecipeContract

    class TestMyRecipe(RecipeContract):
        recipe = "my-recipe"                  # an installed name, or the class itself
        params = {"hidden": [32]}             # model.params for the checks (small is quick)

        def rows(self):                       # a few dozen training rows, with the label column
            return pyarrow.parquet.read_table("tests/data/sample.parquet")

What it checks is what the pipeline relies on (docs/recipes.md says why): the params validate and
describe themselves; fitting the featurizer is deterministic and its saved state round-trips;
`load` refuses a state it cannot use with a FatalError naming its source; features have one shape
per row whatever the rows, and `example` has it too; the model maps a batch to outputs of `width`
columns (a classifier's logits), its loss backpropagates and its optimizer steps; the same seed
gives the same weights, and the forward pass and `embed` compile as one whole graph with static
shapes; a row's outputs do not depend on the other rows of its batch (the last batch is filled with
copies); its `evaluate` gives every gate metric it declares, each of which says which way is
better; and what it publishes is one value or vector per row.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import pyarrow as pa
import pytest
import torch

from trnflow.errors import FatalError
from trnflow.lifecycle.gate import DIRECTIONS
from trnflow.specs import DataSpec, TrainSpec
from trnflow.workload.recipes import METRICS, Recipe, recipe_class

FEATURE_ROWS = (3, 7)
"""Two batch sizes whose features must have the same per-row shape."""


class RecipeContract:
    """Subclass it (its name starting with Test) and set `recipe`, `params` and `rows`."""

    recipe: ClassVar[str | type[Recipe]]
    params: ClassVar[dict[str, Any]] = {}
    label_field: ClassVar[str] = "label"
    text_field: ClassVar[str] = "text"
    id_field: ClassVar[str] = "id"

    def rows(self) -> pa.Table:
        """Training rows: the recipe's columns and the label column."""
        raise NotImplementedError("a RecipeContract subclass gives rows()")

    # -- helpers -----------------------------------------------------------------------------------

    def make(self) -> Recipe:
        cls = self.recipe if isinstance(self.recipe, type) else recipe_class(self.recipe)
        data = DataSpec(train=".", holdout=".", inference=".", label_field=self.label_field,
                        text_field=self.text_field, id_field=self.id_field)
        return cls(cls.Params.model_validate(self.params), data)

    def fitted(self) -> Recipe:
        recipe = self.make()
        recipe.fit(self.rows())
        return recipe

    def model(self, recipe: Recipe, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        return recipe.build_model()

    def labels(self, n: int) -> torch.Tensor:
        """Labels of the first `n` rows (zeros for a recipe whose rows have none)."""
        if self.make().num_classes is None:
            return torch.zeros(n, dtype=torch.long)
        return torch.tensor(self.rows().column(self.label_field).to_pylist()[:n], dtype=torch.long)

    # -- the contract ------------------------------------------------------------------------------

    def test_it_names_itself_and_its_params_describe_every_field(self):
        cls = type(self.make())
        assert cls.name and cls.version, "a recipe has a name and a version"
        assert cls.Params.model_config.get("extra") == "forbid", "Params refuses unknown fields"
        undescribed = [name for name, field in cls.Params.model_fields.items() if not field.description]
        assert not undescribed, f"every parameter has a description: {undescribed}"
        assert cls.metrics, "it declares the gate metrics it supports"
        for metric in cls.metrics:
            assert metric in cls.directions or metric in DIRECTIONS, f"{metric}: say whether higher or lower is better"
        if cls.evaluate is Recipe.evaluate:
            assert set(cls.metrics) <= set(METRICS), f"the default evaluation computes {METRICS}"
        assert set(self.make().columns()) <= set(self.rows().column_names)

    def test_fitting_the_featurizer_is_deterministic_and_its_state_round_trips(self):
        first, second = self.fitted(), self.fitted()
        assert first.state() == second.state(), "the same rows give the same featurizer"
        loaded = self.make()
        loaded.load(first.state(), "the saved featurizer")
        rows = self.rows()
        assert torch.equal(loaded.features(rows), first.features(rows))

    def test_a_state_it_cannot_use_is_refused_naming_its_source(self):
        with pytest.raises(FatalError, match="the-damaged-file"):
            self.make().load(b"\x00\xff not a featurizer state", "the-damaged-file")

    def test_features_have_one_shape_per_row_whatever_the_rows(self):
        recipe, rows = self.fitted(), self.rows()
        shapes = {n: recipe.features(rows.slice(0, n)) for n in FEATURE_ROWS}
        for n, features in shapes.items():
            assert features.shape[0] == n, f"{n} rows give {features.shape[0]} feature rows"
        per_row = {tuple(f.shape[1:]) for f in shapes.values()}
        dtypes = {f.dtype for f in shapes.values()}
        example = recipe.example(5, torch.Generator().manual_seed(0))
        assert len(per_row) == 1 and tuple(example.shape[1:]) in per_row, f"shapes {per_row}, example {example.shape}"
        assert dtypes == {example.dtype}

    def test_the_model_maps_a_batch_to_logits_and_its_loss_backpropagates(self):
        recipe = self.fitted()
        features = recipe.features(self.rows().slice(0, 8))
        model = self.model(recipe)
        logits = model(features)
        assert logits.shape == (len(features), recipe.width)
        loss = recipe.loss(logits, self.labels(len(features)))
        assert loss.dim() == 0 and math.isfinite(loss.item())
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), "every weight is trained"
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trained = [p for p in model.parameters() if p.requires_grad]
        recipe.optimizer(trained, TrainSpec(steps=1, global_batch_size=8, checkpoint_url=".")).step()
        assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "its optimizer moves weights"

    def test_the_same_seed_gives_the_same_weights(self):
        recipe = self.make()
        first, second = self.model(recipe, 7).state_dict(), self.model(recipe, 7).state_dict()
        assert all(torch.equal(first[k], second[k]) for k in first)

    def test_a_rows_outputs_do_not_depend_on_the_rest_of_its_batch(self):
        recipe = self.fitted()
        features = recipe.features(self.rows().slice(0, 4))
        model = self.model(recipe).eval()
        filled = torch.cat([features, features[:1].expand(4, *features.shape[1:])])  # as the last batch is filled
        with torch.no_grad():
            torch.testing.assert_close(model(filled)[:4], model(features), rtol=1e-5, atol=1e-6)
            if recipe.embeds:
                torch.testing.assert_close(model.embed(filled)[:4], model.embed(features), rtol=1e-5, atol=1e-6)

    def test_the_programs_compile_as_whole_graphs_with_static_shapes(self):
        recipe = self.fitted()
        features = recipe.features(self.rows().slice(0, 4))
        model = self.model(recipe).eval()
        torch._dynamo.reset()
        try:
            forward = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
            with torch.no_grad():
                torch.testing.assert_close(forward(features), model(features))
                if recipe.embeds:
                    embed = torch.compile(model.embed, backend="eager", fullgraph=True, dynamic=False)
                    out = embed(features)
                    assert out.dim() == 2 and out.shape[0] == len(features), "embed gives one vector per row"
        finally:
            torch._dynamo.reset()

    def test_it_evaluates_every_metric_it_declares_and_publishes_a_value_per_row(self):
        recipe = self.fitted()
        features = recipe.features(self.rows().slice(0, 6))
        model = self.model(recipe).eval()
        with torch.no_grad():
            outputs = model(features)
            published = recipe.publish(model.embed(features) if recipe.embeds else outputs)
        values = recipe.evaluate(outputs.double(), self.labels(len(features)), list(recipe.metrics))
        missing = [m for m in recipe.metrics if m not in values]
        assert not missing, f"evaluate gives every declared metric: {missing} missing"
        for name in values:  # a run's series records which way each of its metrics is better
            assert name in recipe.directions or name in DIRECTIONS, f"{name}: say whether higher or lower is better"
        assert all(v is None or math.isfinite(v) for v in values.values()), values
        assert any(v is not None for v in values.values()), "evaluate measures something on real rows"
        outcomes = recipe.outcomes(outputs.double(), self.labels(len(features)))
        assert outcomes is None or (len(outcomes) == len(features) and set(outcomes) <= {"0", "1"})
        for name, column in published.items():
            assert column.shape[0] == len(features) and column.dim() in (1, 2), f"{name}: one value or vector a row"
            assert column.dtype in (torch.float32, torch.int64), f"{name}: float32 or int64"

    def test_embeddings_are_declared_as_the_model_has_them(self):
        recipe = self.make()
        assert hasattr(self.model(recipe), "embed") == recipe.embeds, "embeds says whether the model has embed"

