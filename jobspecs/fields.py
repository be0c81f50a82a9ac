"""What every spec section shares: the section base (unknown keys refused, frozen), location
fields, recipe and metric names, and the step bound."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from trnflow.urls import normalise_url

Url = Annotated[str, AfterValidator(normalise_url)]
ChampionOrUrl = Annotated[Literal["champion"] | Url, Field(union_mode="left_to_right")]
"""`champion` (the registry's current champion for this spec's name) or a location."""
ReferenceChoice = Annotated[Literal["champion", "auto"] | Url, Field(union_mode="left_to_right")]
"""`champion`, `auto` (the fp32 reference of this spec and data, trained by the run when none is on
record) or a metrics file's location."""

MAX_STEPS = 10**9
"""More optimizer steps than any run takes: a bound a step counter and its arithmetic honour."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
"""An installed recipe's name, as entry points are named (`m5-text`, `tabular-mlp`)."""
METRIC_NAME = r"^[a-z][a-z0-9_]*$"
"""A metric's name (`gate.metric`, `gate.metrics`): lower-case letters, digits and underscores."""
MODULE_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
"""`package.module:Class`: a recipe named by where it is, imported only where TRNFLOW_RECIPE_MODULES allows."""


def is_module_reference(recipe: str) -> bool:
    """Whether model.recipe names a module (`package.module:attr`) rather than an installed recipe."""
    return ":" in recipe


def recipe_reference(value: str) -> str:
    if is_module_reference(value):
        if not MODULE_REFERENCE.match(value):
            raise ValueError(f"{value!r} is not package.module:attr: write the module's dotted name (letters, digits "
                             "and underscores, no leading dot), a colon, then the recipe class's name")
    elif not RECIPE_NAME.match(value):
        raise ValueError(f"{value!r} is not a recipe's name; `trnflow recipes` lists the installed ones")
    return value
