"""What `trnflow plan --calibrate` asks of the real program before forecasting a run: a short,
timed run of the spec's own training job, on its own backend and layout, for a few steps, with
nothing registered, gated or kept but the timing; and which of its programs the compile cache
already holds (`trnflow compile --check`'s job)."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trnflow.backends import JobRequest, JobState, backend_for, run_to_end
from trnflow.errors import FatalError
from trnflow.results import CompileResult, TrainResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec

CALIBRATION_STEPS = 20
"""Steps a calibration trains: the first pays for loading (or compiling) the graph, the rest give
the steady step time."""


def calibration_spec(spec: JobSpec, steps: int, checkpoint_url: str) -> JobSpec:
    """`spec` for `steps` steps, checkpointing once at the end into `checkpoint_url`, evaluating only
    then, with no deadline, budget or recompilation limit of its own."""
    train = spec.train.model_copy(update={
        "steps": steps, "checkpoint_every": steps, "log_every": steps, "keep_latest": 1,
        "checkpoint_url": checkpoint_url, "max_minutes": None})
    gate = spec.gate.model_copy(update={"eval_every": None})
    # it may run before any compile: the graphs it meets are compiled as it goes
    return spec.model_copy(update={"train": train, "gate": gate, "compile": spec.compile.unlimited()})


def timed_steps(spec: JobSpec, steps: int = CALIBRATION_STEPS, settings: TrnflowSettings | None = None,
              on_logs: Callable[[str], None] | None = None) -> tuple[TrainResult, float]:
    """Train `spec` (its layout decided) for `steps` steps as a job of its backend: the job's result
    and its wall time from submission to end (start-up, data, the first step's graph, the steps,
    the final evaluation and checkpoint). A local job's checkpoints go to a temporary folder and
    are deleted; a cloud job's to `<checkpoint_url>/<run id>/`, as any run's."""
    settings = settings or TrnflowSettings()
    run_id = f"calibrate-{secrets.token_hex(4)}"
    local = spec.compute.backend == "local"
    folder = Path(tempfile.mkdtemp(prefix="trnflow-calibrate-")) if local else None
    job = calibration_spec(spec, min(steps, spec.train.steps), str(folder) if folder else spec.train.checkpoint_url)
    try:
        began = time.monotonic()
        job_id, info = run_to_end(backend_for(job, settings), JobRequest(job, "train", run_id),
                                  settings.poll_seconds, on_logs=on_logs)
        wall = time.monotonic() - began
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    if info.state is not JobState.SUCCEEDED or not isinstance(info.result, TrainResult):
        raise FatalError(f"calibration job {job_id} failed: {info.failed()}")
    if not info.result.steps_trained:
        raise FatalError(f"calibration job {job_id} trained nothing: {info.result.reason}")
    return info.result, wall


def cache_check(spec: JobSpec, settings: TrnflowSettings | None = None) -> CompileResult:
    """Which of `spec`'s programs its compile cache holds and which it would compile: the compile
    phase's warm check, as a job of the spec's backend (it compiles nothing)."""
    settings = settings or TrnflowSettings()
    request = JobRequest(spec, "compile", f"cache-check-{secrets.token_hex(4)}", processes=1, options={"check": True})
    job_id, info = run_to_end(backend_for(spec, settings), request, settings.poll_seconds)
    if info.state is not JobState.SUCCEEDED or not isinstance(info.result, CompileResult):
        raise FatalError(f"compile cache check {job_id} failed: {info.failed()}")
    return info.result
