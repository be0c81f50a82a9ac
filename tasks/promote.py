"""The last step of scheduled retraining: make the gated model the champion.

It comes after batch inference, so a run that fails anywhere leaves the champion, and with it the
data watermark the next run starts from, as they were.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from trnflow.registry import Registry


@task(name="promote", cache_policy=NO_CACHE)
def promote_champion(spec: JobSpec, run_id: str, version: int, generation: int) -> dict:
    """Promote `version`, unless the champion changed since `generation` (the one the gate judged
    against): then PromotionConflict, never retried, names the champion that won."""
    assert spec.registry_url is not None  # retraining checks it
    registry = Registry(spec.registry_url)
    before = registry.champion(spec.name)
    record = registry.promote(spec.name, version, reason=f"retrained and gated ({run_id})",
                              expected_generation=generation)
    was = f" (was v{before.version})" if before else " (the first)"
    watermark = registry.version(spec.name, version).watermark
    return {"version": version, "generation": record["generation"], "watermark": watermark,
            "summary": f"champion v{version}{was}, data up to {watermark}"}
