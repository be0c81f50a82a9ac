"""Stage 3: ahead-of-time compilation into the persistent compile cache."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import run_job


@task(name="compile", cache_policy=NO_CACHE)
def compile_graphs(spec: JobSpec, run_id: str, cores: list[int]) -> dict:
    """Extract every program's graphs, then compile the ones the cache does not hold yet.

    Returns:
        Per-program keys and what happened to each (`report`), with `hits` and `compiled` counts.
    """
    result = run_job(spec, "compile", run_id, processes=1, cores=cores[:1])
    total = len(result["programs"])
    compiled = f", {result['compiled']} compiled in {result['seconds']:.1f}s" if result["compiled"] else ""
    result["summary"] = f"{total} programs: {result['hits']} cache hit(s){compiled}"
    return result
