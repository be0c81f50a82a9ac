"""Publishing a stage's tables and charts on its flow run, as Prefect artifacts keyed
`<spec name>-<what>`, so the UI shows the newest of each beside the run's history. A failure to
publish is logged and never fails the stage: the job's outcome matters more than its report."""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

from prefect import artifacts, get_run_logger

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
    artifacts.create_markdown_artifact(text, key=f"{spec.name}-{what}", description=description)


@_logged
def image(spec: JobSpec, what: str, png: bytes, description: str) -> None:
    artifacts.create_image_artifact(f"data:image/png;base64,{base64.b64encode(png).decode()}",
                                    key=f"{spec.name}-{what}", description=description)


@_logged
def link(spec: JobSpec, what: str, url: str, text: str) -> None:
    artifacts.create_link_artifact(url, link_text=text, key=f"{spec.name}-{what}", description=text)


@_logged
def table(spec: JobSpec, what: str, rows: list[dict[str, Any]], description: str) -> None:
    artifacts.create_table_artifact(rows, key=f"{spec.name}-{what}", description=description)
