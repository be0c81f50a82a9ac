"""The last step of scheduled retraining: make the gated model the champion, then publish the
embeddings it made.

It comes after batch inference (into the run's staging folder), so a run that fails anywhere
before it leaves the champion, the data watermark the next run starts from, and the published
embeddings as they were.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from trnflow.lifecycle.registry import Registry
from trnflow.results import PromoteResult
from trnflow.specs import JobSpec
from trnflow.storage import join
from trnflow.tasks import _artifacts
from trnflow.workload.embeddings import MANIFEST, publish, staging_url


@task(name="promote", cache_policy=NO_CACHE)
def promote_champion(spec: JobSpec, run_id: str, version: int, generation: int) -> PromoteResult:
    """Promote `version`, unless the champion changed since `generation` (the one the gate judged
    against): then PromotionConflict, never retried, names the champion that won. Then publish
    the embeddings staged by this run's inference."""
    assert spec.registry_url is not None  # retraining checks it
    registry = Registry(spec.registry_url)
    before = registry.champion(spec.name)
    record = registry.promote(spec.name, version, reason=f"retrained and gated ({run_id})",
                              expected_generation=generation)
    was = f" (was v{before.version})" if before else " (the first)"
    champion = registry.version(spec.name, version)
    result = PromoteResult(version=version, generation=record["generation"], watermark=champion.watermark,
                           summary=f"champion v{version}{was}, data up to {champion.watermark}")
    published = publish_embeddings(spec, run_id, champion.checkpoint)
    if published is not None:
        result.published, result.summary = published[0], f"{result.summary}; {published[1]}"
    return result


def publish_embeddings(spec: JobSpec, run_id: str, checkpoint: str) -> tuple[str, str] | None:
    """Publish the embeddings `run_id` staged with `checkpoint`, if it staged a complete set of
    them (the link artifact names them): their manifest's URL and how many, else None."""
    output_url = spec.inference.output_url
    document = publish(staging_url(output_url, run_id), output_url, checkpoint)
    if document is None:
        return None
    manifest = join(output_url, MANIFEST)
    _artifacts.link(spec, "embeddings", manifest, f"{document['rows']} embeddings of {document['model_version']} "
                    f"in {len(document['shards'])} Parquet shard(s) under {output_url}")
    return manifest, f"{document['rows']} embeddings published"
