"""Running stages one after another, recording a summary row for each, and stopping at the first
failure with the rows so far."""

from __future__ import annotations

import re
import time
from typing import Any

from jobspecs import JobSpec
from tasks.retry_policy import retry_options
from trnflow.cost import job_cost, total


class PipelineFailed(Exception):
    """A stage failed. `stages` has a row per stage that ran; `cause` is the stage's own error."""

    def __init__(self, stage: str, cause: BaseException, stages: list[dict[str, Any]]):
        super().__init__(f"stage {stage} failed: {cause}")
        self.stage, self.cause, self.stages = stage, cause, stages


class StageRunner:
    """Calls each stage task with the spec's retry policy; keeps rows and results."""

    def __init__(self, spec: JobSpec, run_id: str):
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,128}", run_id) or run_id in (".", ".."):
            raise ValueError(f"run id {run_id!r}: use letters, digits, '.', '_' and '-' only")
        self.spec, self.run_id = spec, run_id
        self.rows: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}
        self.costs: list[dict[str, Any]] = []
        self._options = retry_options(spec)

    def __call__(self, name: str, task, *args) -> dict:
        began = time.monotonic()
        state = task.with_options(**self._options)(self.spec, self.run_id, *args, return_state=True)
        seconds = time.monotonic() - began
        if state.is_completed():
            result = state.result()
            label = "Skipped" if state.name == "Skipped" else "Completed"
            self.rows.append({"stage": name, "state": label, "seconds": seconds, "summary": result["summary"]})
            if result.get("billable_seconds") is not None:  # the stage ran a job
                self.costs.append(job_cost(self.spec, name, result["billable_seconds"]))
            self.results[name] = result
            return result
        error = state.result(raise_on_failure=False)
        self.rows.append({"stage": name, "state": state.type.value.title(), "seconds": seconds,
                          "summary": str(error)})
        raise PipelineFailed(name, error, self.rows)

    def skip(self, name: str, reason: str) -> None:
        """Record a stage that did not run because there was nothing for it to do."""
        self.rows.append({"stage": name, "state": "Skipped", "seconds": 0.0, "summary": reason})

    def outcome(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "stages": self.rows, "results": self.results,
                "cost": {"rows": self.costs, "total_usd": total(self.costs)}}


def new_run_id() -> str:
    import uuid

    from prefect.runtime import flow_run

    flow_run_id = flow_run.get_id()
    suffix = str(flow_run_id)[:8] if flow_run_id else uuid.uuid4().hex[:8]
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{suffix}"
