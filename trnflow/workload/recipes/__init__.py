"""Recipes: the models trnflow can train, each a `Recipe` (see `base`).

A spec names one as `model.recipe`: the name of an installed recipe. Installed recipes register
under the entry-point group `trnflow.recipes` (trnflow's own `m5-text` does too):

    [project.entry-points."trnflow.recipes"]
    tabular-mlp = "tabular_recipe:TabularMLP"

`trnflow recipes` lists them with their parameters. A recipe is code, and a spec is not trusted
to choose code: where the settings allow it (TRNFLOW_RECIPE_MODULES=1), and only there, a spec may
name any importable module as `package.module:attr`. Validation then only looks the module up
(`findable`), without running it; the job imports it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import re
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from trnflow.device import plans
from trnflow.errors import FatalError
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec, SpecError, is_module_reference
from trnflow.specs.spec import MODULE_REFERENCE, RECIPE_NAME
from trnflow.workload.recipes.base import METRICS, Recipe

GROUP = "trnflow.recipes"
BUILTIN = {"m5-text": "trnflow.workload.recipes.m5_text:M5Text"}
"""trnflow's own recipes, found even where the package's entry points are not installed (a source tree)."""

__all__ = ["BUILTIN", "GROUP", "METRICS", "Recipe", "for_job", "installed", "problems", "recipe_class",
           "recipe_for"]


def installed() -> dict[str, str]:
    """Every installed recipe: name -> `module:attr`."""
    found = dict(BUILTIN)
    found.update({ep.name: ep.value for ep in entry_points(group=GROUP)})
    return dict(sorted(found.items()))


def _target(ref: str) -> str:
    """`module:attr` of the recipe `ref` names, once it is one trnflow may import."""
    known = installed()
    if not is_module_reference(ref):
        if ref not in known:
            raise FatalError(f"model.recipe: {ref!r} is not an installed recipe (installed: {', '.join(known)}); "
                             "install the package that provides it")
        return known[ref]
    if not MODULE_REFERENCE.match(ref):
        raise FatalError(f"model.recipe: {ref!r} is not package.module:attr (a dotted module name, a colon, "
                         "then the recipe class's name)")
    if ref not in known.values() and not TrnflowSettings().recipe_modules:
        raise FatalError(f"model.recipe: {ref!r} names a module, and importing a module runs its code: trnflow "
                         "takes recipes from installed packages (`trnflow recipes` lists them); install it with an "
                         "entry point under trnflow.recipes, or set TRNFLOW_RECIPE_MODULES=1 where every spec is "
                         "trusted")
    return ref


def well_formed(recipe: str) -> bool:
    """Whether model.recipe is written as a recipe's name or as package.module:attr."""
    return bool((MODULE_REFERENCE if is_module_reference(recipe) else RECIPE_NAME).match(recipe))


def findable(module: str) -> bool:
    """Whether `module` (dotted) can be imported, found without running any of it or of its packages."""
    parts = module.split(".")
    try:
        found = importlib.util.find_spec(parts[0])  # a top-level name is looked up, not imported
        for part in parts[1:]:
            if found is None or not found.submodule_search_locations:
                return False
            found = importlib.machinery.PathFinder.find_spec(part, list(found.submodule_search_locations))
    except (ImportError, ValueError):
        return False
    return found is not None


def recipe_class(ref: str) -> type[Recipe]:
    """The recipe `ref` names: an installed recipe's name, or `package.module:attr` where the settings
    allow it (FatalError otherwise, or when it cannot be loaded). Imports its module."""
    target = _target(ref)
    module_name, _, attr = target.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise FatalError(f"model.recipe: {ref!r} points at {target}, which cannot be loaded ({exc}); "
                         "check that its package is installed in this environment") from None
    if not (isinstance(found, type) and issubclass(found, Recipe)):
        raise FatalError(f"model.recipe: {target} is not a trnflow Recipe subclass")
    return found


def _params_problems(exc: ValidationError) -> list[str]:
    lines = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        own = re.match(r"^(\w+): (.*)$", message, re.DOTALL)
        if not where and own:  # a Params validator that names the field it is about
            where, message = own.groups()
        lines.append(f"model.params{'.' + where if where else ''}: {message}")
    return lines


def model_problems(data: dict[str, Any]) -> list[str]:
    """What stops a parsed spec's model: its recipe cannot be found, its params do not fit the
    recipe's Params, or the gate asks for a metric the recipe does not support; as `field: message`
    lines. A model section that is not of the recipe-and-params form is the spec's own error."""
    model = data.get("model", {})
    if not isinstance(model, dict) or set(model) - {"recipe", "params"}:
        return []
    recipe, params = model.get("recipe", "m5-text"), model.get("params", {})
    if not isinstance(recipe, str) or not isinstance(params, dict) or not well_formed(recipe):
        return []  # the spec's own error
    try:
        target = _target(recipe)
    except FatalError as exc:
        return [str(exc)]
    if target == recipe and recipe not in installed().values():  # a module by name: looked up, not run
        module = recipe.partition(":")[0]
        return [] if findable(module) else [f"model.recipe: no module {module!r} can be imported here; check "
                                            "that its package is installed in this environment"]
    try:
        cls = recipe_class(recipe)
    except FatalError as exc:
        return [str(exc)]
    try:
        cls.Params.model_validate(params)
    except ValidationError as exc:
        return _params_problems(exc)
    inference = data.get("inference") or {}
    generate = inference.get("generate") if isinstance(inference, dict) else None
    if generate and not cls.generates:
        return [f"inference.generate: recipe {cls.name} does not generate text (hf-causal-lm does); remove it"]
    if _flag(generate, "kv_cache", True) and (problem := cls.kv_cache_problem(cls.Params.model_validate(params))):
        return [f"inference.generate.kv_cache: {problem}"]
    if _flag(data.get("data"), "packing", False):
        if not cls.packs:
            return [f"data.packing: recipe {cls.name} does not pack rows (hf-causal-lm does); remove it"]
        if problem := cls.packing_problem(cls.Params.model_validate(params)):
            return [f"data.packing: {problem}"]
    gate = data.get("gate") or {}
    if not isinstance(gate, dict):
        return []  # the spec's own error
    extra = gate.get("metrics") or []
    wanted = [gate.get("metric", "accuracy"), *(extra if isinstance(extra, list) else [])]
    return [f"gate: metric {name!r} is not one recipe {cls.name} supports ({', '.join(cls.metrics)})"
            for name in wanted if isinstance(name, str) and name not in cls.metrics]


def _flag(section: object, name: str, default: bool) -> bool:
    """A spec section's yes-or-no setting as the spec reads it (`data.packing`, say); False where
    the section is not there or the setting not a yes or no (the spec's own error)."""
    if not isinstance(section, dict):
        return False
    try:
        return TypeAdapter(bool).validate_python(section.get(name, default))
    except ValidationError:
        return False


def canonical_params(data: dict[str, Any]) -> dict[str, Any]:
    """The parsed spec with its model's params as the recipe writes them (`Recipe.canonical_params`);
    as it was for a spec whose model section is not yet of the recipe-and-params form, or whose
    recipe is a module that is only looked up, never run, before the job."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("params", {}), dict):
        return data
    recipe = model.get("recipe", "m5-text")
    if not isinstance(recipe, str) or not well_formed(recipe) or recipe not in installed():
        return data
    try:
        cls = recipe_class(recipe)
    except FatalError:
        return data  # model_problems says why
    params = cls.canonical_params(model.get("params", {}))
    return data if params == model.get("params", {}) else {**data, "model": {**model, "params": params}}


def problems(spec: JobSpec) -> list[str]:
    """`model_problems` of a validated spec."""
    return model_problems(spec.model_dump(mode="json"))


class RecipeChecks:
    """The recipe's checks of a spec (`trnflow.specs.loader.ModelChecks`), which the composition
    roots pass to the loader: `canonical_params`, then `model_problems`."""

    def rewrite(self, data: dict[str, Any]) -> dict[str, Any]:
        return canonical_params(data)

    def problems(self, data: dict[str, Any]) -> list[str]:
        return model_problems(data)


RECIPES = RecipeChecks()


def recipe_for(spec: JobSpec) -> Recipe:
    """The spec's recipe with its params validated; SpecError lists what is wrong."""
    found = problems(spec)
    if found:
        raise SpecError("<spec>", found)
    cls = recipe_class(spec.model.recipe)
    return cls(cls.Params.model_validate(spec.model.params), spec.data)


def for_job(spec: JobSpec) -> Recipe:
    """`recipe_for` in a job, where a spec that got this far and still does not fit is fatal."""
    try:
        return recipe_for(spec)
    except SpecError as exc:
        raise FatalError("; ".join(exc.problems)) from None


def source_files(recipe: type[Recipe] | Recipe) -> list[Path]:
    """The files the recipe's code is in: its module, or every module of its package."""
    module = sys.modules[recipe.__module__]
    path = Path(module.__file__ or "")
    return sorted(path.parent.glob("*.py")) if path.name == "__init__.py" else [path]


def plan_digest(spec: JobSpec) -> str:
    """The compile plan's digest for `spec` (`trnflow.device.plans`), with its recipe's code."""
    cls = recipe_class(spec.model.recipe)
    return plans.plan_digest(spec, f"{cls.name}@{cls.version}", source_files(cls))
