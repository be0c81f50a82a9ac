"""Stage 3: ahead-of-time compilation into the persistent compile cache."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import run_job


@task(name="compile", cache_policy=NO_CACHE)
def compile_graphs(spec: JobSpec, run_id: str, cores: list[int]) -> dict:
    """Capture the training step's graphs and compile them unless the cache already holds them."""
    result = run_job(spec, "compile", run_id, processes=1, cores=cores[:1])
    verb = "cache hit" if result["hit"] else f"compiled in {result['seconds']:.1f}s"
    result["summary"] = f"{result['graphs']} graph(s), {verb} ({result['key']})"
    return result
