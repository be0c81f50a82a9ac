"""Stage 2: collective tests between the cores, in the style of nccom-test."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import run_job


@task(name="collectives", cache_policy=NO_CACHE)
def collective_test(spec: JobSpec, run_id: str) -> dict:
    """All-reduce sweep across every core, each result checked; reports algbw and busbw."""
    result = run_job(spec, "collectives", run_id)
    if result["avg_busbw"] is None:
        result["summary"] = result.get("note", "skipped")
    else:
        result["summary"] = f"all_reduce ok on {result['ranks']} cores, avg busbw {result['avg_busbw']:.3f} GB/s"
    return result
