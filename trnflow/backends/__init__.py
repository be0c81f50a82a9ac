"""Backends: where a stage job runs. Flows and tasks see only the `Backend` protocol."""

from __future__ import annotations

from jobspecs import JobSpec
from trnflow.backends.base import Backend, JobInfo, JobRequest, JobState, run_to_end, wait
from trnflow.errors import FatalError
from trnflow.settings import TrnflowSettings

__all__ = ["Backend", "JobInfo", "JobRequest", "JobState", "backend_for", "run_to_end", "wait"]


def backend_for(spec: JobSpec, settings: TrnflowSettings | None = None) -> Backend:
    """The backend named by `spec.compute.backend`: the one place that chooses."""
    settings = settings or TrnflowSettings()
    if spec.compute.backend == "local":
        from trnflow.backends.local import LocalBackend

        return LocalBackend(settings.jobs_dir)
    raise FatalError(
        f"compute.backend {spec.compute.backend!r} is not available in this version of trnflow; "
        "use compute.backend: local (the NeuronCore emulator)"
    )
