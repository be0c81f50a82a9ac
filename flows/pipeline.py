"""The six-stage training pipeline as one Prefect flow.

sanity -> collectives -> compile -> train -> evaluate (parity gate) -> infer

The flow only composes tasks; where the jobs run is the spec's business (compute.backend).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from prefect import flow
from prefect.runtime import flow_run

from jobspecs import JobSpec
from tasks.collectives import collective_test
from tasks.compile import compile_graphs
from tasks.evaluate import evaluate_gate
from tasks.infer import batch_infer
from tasks.retry_policy import retry_options
from tasks.sanity import sanity_check
from tasks.train import train_model

STAGES = ("sanity", "collectives", "compile", "train", "evaluate", "infer")


class PipelineFailed(Exception):
    """A stage failed. `stages` has a row per stage that ran; `cause` is the stage's own error."""

    def __init__(self, stage: str, cause: BaseException, stages: list[dict[str, Any]]):
        super().__init__(f"stage {stage} failed: {cause}")
        self.stage, self.cause, self.stages = stage, cause, stages


def _new_run_id() -> str:
    flow_run_id = flow_run.get_id()
    suffix = str(flow_run_id)[:8] if flow_run_id else uuid.uuid4().hex[:8]
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{suffix}"


@flow(name="trnflow-pipeline", log_prints=True)
def pipeline(spec: JobSpec, run_id: str | None = None) -> dict[str, Any]:
    """Run all six stages for one job spec.

    Args:
        spec: the job spec (validated; the Prefect UI renders it as a form).
        run_id: names this run's checkpoint folder; a rerun with the same id resumes it.

    Returns:
        `run_id`, one summary row per stage, and each stage's full result under `results`.
    """
    run_id = run_id or _new_run_id()
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    options = retry_options(spec)

    def stage(name: str, task, *args) -> dict:
        began = time.monotonic()
        state = task.with_options(**options)(spec, run_id, *args, return_state=True)
        seconds = time.monotonic() - began
        if state.is_completed():
            result = state.result()
            rows.append({"stage": name, "state": "Completed", "seconds": seconds, "summary": result["summary"]})
            results[name] = result
            return result
        error = state.result(raise_on_failure=False)
        rows.append({"stage": name, "state": state.type.value.title(), "seconds": seconds, "summary": str(error)})
        raise PipelineFailed(name, error, rows)

    stage("sanity", sanity_check)
    stage("collectives", collective_test)
    stage("compile", compile_graphs)
    checkpoint = stage("train", train_model)["checkpoint"]
    stage("evaluate", evaluate_gate, checkpoint)
    stage("infer", batch_infer, checkpoint)
    return {"run_id": run_id, "stages": rows, "results": results}
