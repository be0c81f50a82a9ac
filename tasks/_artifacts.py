"""Publishing a stage's tables and charts on its flow run, as Prefect artifacts keyed
`<spec name>-<what>`, so the UI shows the newest of each beside the run's history. A chart is a
Markdown artifact with the image inline (an image artifact's page prints its whole data URL), and
a location is Markdown too: a link only where a browser can open it (S3's console), else a plain path. Text
is published with secrets masked, as log lines are. A failure to publish is logged and never fails the
stage: the job's outcome matters more than its report."""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

from prefect import artifacts, get_run_logger

from trnflow.redact import Redactor
from trnflow.reporting.report import location_markdown
from trnflow.specs import JobSpec


def _logged(publish: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(publish)
    def wrapper(spec: JobSpec, what: str, *args: Any) -> None:
        try:
            publish(spec, what, *args)
        except Exception as exc:
            get_run_logger().warning("could not attach the %s artifact %s-%s: %s", what, spec.name, what, exc)

    return wrapper


@_logged
def markdown(spec: JobSpec, what: str, text: str, description: str) -> None:
    artifacts.create_markdown_artifact(Redactor.from_env()(text), key=f"{spec.name}-{what}", description=description)


@_logged
def image(spec: JobSpec, what: str, png: bytes, description: str) -> None:
    data = f"data:image/png;base64,{base64.b64encode(png).decode()}"
    artifacts.create_markdown_artifact(f"![{what}]({data})\n", key=f"{spec.name}-{what}", description=description)


@_logged
def link(spec: JobSpec, what: str, url: str, text: str) -> None:
    redact = Redactor.from_env()
    artifacts.create_markdown_artifact(redact(f"{text}: {location_markdown(url)}\n"), key=f"{spec.name}-{what}",
                                       description=redact(text))


@_logged
def table(spec: JobSpec, what: str, rows: list[dict[str, Any]], description: str) -> None:
    redact = Redactor.from_env()
    masked = [{k: redact(v) if isinstance(v, str) else v for k, v in row.items()} for row in rows]
    artifacts.create_table_artifact(masked, key=f"{spec.name}-{what}", description=description)
