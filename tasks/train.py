"""Stage 4: training from a checkpoint, resumed exactly when a retry follows a transient failure."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import recompile_note, run_job


@task(name="train", cache_policy=NO_CACHE)
def train_model(spec: JobSpec, run_id: str, cores: list[int]) -> dict:
    """Train on every core with DDP. A retry of the same run resumes from its newest checkpoint.

    Returns:
        The train result; `checkpoint` is the URL of the final checkpoint.
    """
    result = run_job(spec, "train", run_id, cores=cores)
    resumed = f", resumed at step {result['start_step']}" if result["resumed_from"] else ""
    result["summary"] = (f"{result['steps_trained']} steps, loss {result['loss']:.4f}, "
                         f"{result['samples_per_s']:.0f} samples/s{resumed}{recompile_note(result)}")
    return result
