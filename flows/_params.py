"""What every flow takes and shows: the job spec, given inline (a typed parameter the Prefect UI
renders as a form) or by URL, and a run name that says what ran."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.runtime import flow_run
from prefect.states import Failed, State
from pydantic import WithJsonSchema

from trnflow.errors import TrnflowError
from trnflow.flows._stages import PipelineFailed, failed_state
from trnflow.specs import JobSpec, SpecError, load_spec, parse_spec, validate_spec
from trnflow.storage import open_store

_CHECKED_BY_THE_FLOW = frozenset({"pattern", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                                  "minLength", "maxLength", "minItems", "maxItems", "multipleOf"})
"""JSON-schema keywords the run form leaves to the flow: a value the UI would refuse with a message
naming no field (`... is not valid under any of the given schemas`) is refused by the run instead,
as `trnflow validate` refuses it: `name: ... ; use ...`."""


def _inline(node: Any, defs: dict[str, Any], fields: bool = False) -> Any:
    """`node` with every `$ref` replaced by its definition and the checked keywords dropped
    (`fields`: node is a `properties` mapping, whose keys are field names, all kept)."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if fields:
        return {name: _inline(value, defs) for name, value in node.items()}
    if "$ref" in node:
        return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    return {k: _inline(v, defs, fields=k == "properties") for k, v in node.items()
            if k != "$defs" and k not in _CHECKED_BY_THE_FLOW}


@functools.cache
def form_schema() -> dict[str, Any]:
    """The JobSpec as the Prefect UI's run form shows it: every section inline, with its fields'
    types, choices, defaults and descriptions; value checks are the flow's (see above)."""
    schema = JobSpec.model_json_schema()
    return _inline(copy.deepcopy(schema), schema.get("$defs", {}))


P = ParamSpec("P")
R = TypeVar("R")

SpecParam = Annotated[JobSpec, WithJsonSchema(form_schema())]
"""The type of every flow's `spec` parameter: a JobSpec, shown to the UI by `form_schema`. Flows
take it unvalidated (`validate_parameters=False`) and `resolve_spec` validates it, so a bad value
fails the run with the loader's message."""


def ends_with_reason(flow_fn: Callable[P, R]) -> Callable[P, R | State]:
    """A flow function whose run, when trnflow stops it, ends Failed with the reason in one line as
    its state message (the UI shows its first 70 or so characters), logged without a traceback: a
    refused spec (a bad value from the UI's form, a spec_url that cannot be read) with its problems,
    `name: ... ; use ...` first; a failed stage (`train failed: ...`) or gate (`GateFailed`); a check
    before the first job. Any other error (a bug) is raised, traceback and all. Apply it under `@flow`."""

    @functools.wraps(flow_fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R | State:
        try:
            return flow_fn(*args, **kwargs)
        except SpecError as exc:
            get_run_logger().error("%s", exc)
            return Failed(message="; ".join(exc.problems) + f" ({exc.source})")
        except (PipelineFailed, TrnflowError) as exc:
            state = failed_state(exc)
            get_run_logger().error("%s", state.message if isinstance(exc, PipelineFailed) else exc)
            return state

    return checked


def resolve_spec(spec: JobSpec | dict[str, Any] | None, spec_url: str | None) -> JobSpec:
    """The run's spec (`_spec`), with `train.parallelism.strategy: auto` decided once for all of the
    run's jobs (the memory planner's choice), so that its compile plan and every job agree."""
    from trnflow.workload.memory import decided  # builds the model on the meta device: torch

    return decided(_spec(spec, spec_url))


def _spec(spec: JobSpec | dict[str, Any] | None, spec_url: str | None) -> JobSpec:
    """The run's spec: `spec` itself when given (it wins over `spec_url`), validated when it came
    as data (a run started from the UI or the API), else the file `spec_url` names (a path,
    file:// or s3:// URL).

    Relative locations inside a spec read from a URL resolve against the flow's working directory.
    """
    if isinstance(spec, JobSpec):
        return spec
    if spec is not None:
        return validate_spec(spec, "spec (the run's parameter)")
    if not spec_url:
        raise SpecError("parameters", ["give the job spec: `spec` (the spec itself) or `spec_url` (where to read it)"])
    scheme, sep, _ = spec_url.partition("://")
    if not sep or scheme == "file":
        return load_spec(Path(spec_url.removeprefix("file://")))
    if scheme != "s3":
        raise SpecError(spec_url, [f"spec_url: unsupported scheme {scheme!r}; use a path, file:// or s3://"])

    base, _, name = spec_url.rpartition("/")
    try:
        text = open_store(base).read(name).decode("utf-8")
    except FileNotFoundError:
        raise SpecError(spec_url, ["(file): not found; check spec_url"]) from None
    return parse_spec(text, spec_url)


def name_run(spec: JobSpec, what: str) -> str:
    """Rename the current flow run to `<spec name>: <what>`, as the UI and `trnflow runs` list it."""
    name = f"{spec.name}: {what}"
    run_id = flow_run.get_id()
    if run_id:
        with get_client(sync_client=True) as client:
            client.update_flow_run(run_id, name=name)
    return name


def window(spec: JobSpec) -> str:
    """The data a training run reads, in words."""
    return "all partitions" if spec.data.window == "all" else "partitions after the starting checkpoint's watermark"
