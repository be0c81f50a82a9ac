"""What every flow takes and shows: the job spec, given inline (a typed parameter the Prefect UI
renders as a form) or by URL, and a run name that says what ran."""

from __future__ import annotations

import copy
import functools
import os
import signal
import threading
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
from trnflow.workload.recipes import RECIPES

_CHECKED_BY_THE_FLOW = frozenset({"pattern"})
"""JSON-schema keywords the run form leaves to the flow: a pattern's failure would only quote the
regular expression, while the run refuses the value as `trnflow validate` does, naming the field
and what to write (`name: 'Quick Start' is not allowed here; use lower-case letters, ...`)."""

_TEXT = ({"type": "string"}, {"type": "null"})
"""How the form shows a field that takes text or nothing: one text box."""


def _one_text_box(node: dict[str, Any]) -> dict[str, Any]:
    """A field whose choices are all text (`champion` or a URL, or nothing) as one text box: the UI
    would show each choice as a tab of its own, the `champion` one greyed out as a constant."""
    choices = node.get("anyOf")
    if not choices or len(choices) < 3 or not all(c.get("type") in ("string", "null") for c in choices):
        return node
    return {**node, "anyOf": [dict(c) for c in _TEXT]}


def _inline(node: Any, defs: dict[str, Any], fields: bool = False) -> Any:
    """`node` with every `$ref` replaced by its definition and the keywords left to the flow dropped
    (`fields`: node is a `properties` mapping, whose keys are field names, all kept)."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if fields:
        return {name: _inline(value, defs) for name, value in node.items()}
    if "$ref" in node:
        return _inline(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    return _one_text_box({k: _inline(v, defs, fields=k == "properties") for k, v in node.items()
                          if k != "$defs" and k not in _CHECKED_BY_THE_FLOW})


@functools.cache
def form_schema() -> dict[str, Any]:
    """The JobSpec as the Prefect UI's run form shows it and the server checks it: every section
    inline, with its fields' types, choices, bounds, defaults and descriptions. The deployments
    enforce it, so a value out of its bounds is refused when the run is created, naming the field
    (`spec.train.steps`: `-5 is less than the minimum of 1`); patterns and the checks between
    fields are the run's, which refuses a bad value naming the field and the fix."""
    schema = JobSpec.model_json_schema()
    return _inline(copy.deepcopy(schema), schema.get("$defs", {}))


PARAMETER = "spec"
"""Where a spec given as the run's parameter came from, as its errors name it."""

P = ParamSpec("P")
R = TypeVar("R")

SpecParam = Annotated[JobSpec | None, WithJsonSchema(form_schema())]
"""The type of every flow's `spec` parameter: a JobSpec, or none when `spec_url` says where to read
it. The UI sees `form_schema` alone, not "a JobSpec or null": a choice between the two would make
the form report any bad value inside the spec as the whole spec `is not valid under any of the given
schemas`, naming no field. Flows take it unvalidated (`validate_parameters=False`) and
`resolve_spec` validates it, so a value the schema lets through fails the run with the loader's
message."""


SERVED = "TRNFLOW_SERVED"
"""Set in the environment of the flow runs `trnflow serve` starts: they share its terminal, whose
Ctrl-C must reach only `trnflow serve`, which then cancels them (`ignore_terminal_interrupts`)."""


def ignore_terminal_interrupts() -> None:
    """In a flow run that `trnflow serve` started, ignore SIGINT: a Ctrl-C in serve's terminal goes
    to every process of its group, and would end the run wherever it was, leaving it Running on the
    server. Serve cancels it instead (SIGTERM, which Prefect turns into a clean cancellation)."""
    if os.environ.get(SERVED) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def ends_with_reason(flow_fn: Callable[P, R]) -> Callable[P, R | State]:
    """A flow function whose run, when trnflow stops it, ends Failed with the reason in one line as
    its state message (the UI shows its first 70 or so characters), logged without a traceback: a
    refused spec (a bad value from the UI's form, a spec_url that cannot be read) with its problems,
    `name: ... ; use ...` first; a failed stage (`train failed: ...`) or gate (`GateFailed`); a check
    before the first job. Any other error (a bug) is raised, traceback and all. Apply it under `@flow`."""

    @functools.wraps(flow_fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R | State:
        ignore_terminal_interrupts()
        try:
            return flow_fn(*args, **kwargs)
        except SpecError as exc:
            get_run_logger().error("%s", exc)
            where = "" if exc.source == PARAMETER else f" ({exc.source})"
            return Failed(message="; ".join(exc.problems) + where)
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
        return validate_spec(spec, PARAMETER, RECIPES)
    if not spec_url:
        raise SpecError("parameters", ["give the job spec: `spec` (the spec itself) or `spec_url` (where to read it)"])
    scheme, sep, _ = spec_url.partition("://")
    if not sep or scheme == "file":
        return load_spec(Path(spec_url.removeprefix("file://")), model=RECIPES)
    if scheme != "s3":
        raise SpecError(spec_url, [f"spec_url: unsupported scheme {scheme!r}; use a path, file:// or s3://"])

    base, _, name = spec_url.rpartition("/")
    try:
        text = open_store(base).read(name).decode("utf-8")
    except FileNotFoundError:
        raise SpecError(spec_url, ["(file): not found; check spec_url"]) from None
    return parse_spec(text, spec_url, model=RECIPES)


def first_name(what: str) -> Callable[[], str]:
    """A flow's `flow_run_name`: `<spec name>: <what>`, from the run's parameters as they came (the
    spec, or the file `spec_url` names), so that every run is named for what it runs from its start,
    a scheduled one or one whose spec is then refused included. The flow renames it once it knows
    more (`name_run`)."""

    def name() -> str:
        params = flow_run.parameters
        spec, url = params.get("spec"), params.get("spec_url")
        named = spec.name if isinstance(spec, JobSpec) else spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(named, str) or not named.strip():
            named = Path(str(url)).stem if url else "trnflow"
        return f"{' '.join(named.split())[:63]}: {what}"

    return name


def name_run(spec: JobSpec, what: str) -> str:
    """Rename the current flow run to `<spec name>: <what>`, as the UI and `trnflow runs` list it."""
    name = f"{spec.name}: {what}"
    run_id = flow_run.get_id()
    if run_id:
        with get_client(sync_client=True) as client:
            client.update_flow_run(run_id, name=name)
    return name


def pipeline_name(spec: JobSpec) -> str:
    """What a pipeline run does, in words: `pipeline: 300 steps on 2 cores, all partitions`."""
    data = "all partitions" if spec.data.window == "all" else "the partitions after its starting checkpoint's watermark"
    cores = spec.compute.world_size
    return f"pipeline: {spec.train.steps} steps on {cores} core{'s' if cores > 1 else ''}, {data}"
