"""Stage 1: hardware sanity checks on every NeuronCore."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import run_job
from trnflow.errors import FatalError


@task(name="sanity", cache_policy=NO_CACHE)
def sanity_check(spec: JobSpec, run_id: str) -> dict:
    """Known-answer tensor tests on each core of the spec's topology.

    Returns:
        The per-core results, with a `summary` line. Raises FatalError naming every bad core.
    """
    result = run_job(spec, "sanity", run_id)
    cores = result["cores"]
    if result["bad_cores"]:
        raise FatalError(
            f"NeuronCore(s) {result['bad_cores']} failed the known-answer tests; "
            "replace the instance or exclude those cores"
        )
    result["summary"] = f"{len(cores)}/{len(cores)} cores passed"
    return result
