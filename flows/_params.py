"""What every flow takes and shows: the job spec, given inline (a typed parameter the Prefect UI
renders as a form) or by URL, and a run name that says what ran."""

from __future__ import annotations

from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from trnflow.specs import JobSpec, SpecError, load_spec, parse_spec
from trnflow.storage import open_store


def resolve_spec(spec: JobSpec | None, spec_url: str | None) -> JobSpec:
    """The run's spec: `spec` itself when given (it wins over a deployment's default `spec_url`),
    else the file `spec_url` names (a path, file:// or s3:// URL).

    Relative locations inside a spec read from a URL resolve against the flow's working directory.
    """
    if spec is not None:
        return spec
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
