"""The last step of a run that trains: make the gated model the champion and publish its outputs.

It comes after batch inference wrote the model's outputs into its own version folder, so a run
that fails anywhere before it leaves the champion, the data watermark the next run starts from and
the published outputs as they were. The champion and the `current` pointer move together: if the
pointer cannot be moved, the promotion is rolled back.
"""

from __future__ import annotations

import contextlib
import json

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.errors import FatalError
from trnflow.lifecycle.digests import check_version
from trnflow.lifecycle.registry import ModelVersion, Registry
from trnflow.results import PromoteResult
from trnflow.specs import JobSpec
from trnflow.storage import join, open_store
from trnflow.tasks import _artifacts
from trnflow.workload.embeddings import CURRENT, MANIFEST, current, latest_folder, point_current


@task(name="promote", cache_policy=NO_CACHE)
def promote_champion(spec: JobSpec, run_id: str, version: int, generation: int, forced: str | None = None
                     ) -> PromoteResult:
    """Promote `version`, unless the champion changed since `generation` (the one the gate judged
    against): then PromotionConflict, never retried, names the champion that won. Then point
    `current` at the outputs this run's inference wrote for it."""
    assert spec.registry_url is not None  # the flows promote only with a registry
    registry = Registry(spec.registry_url)
    before = registry.champion(spec.name)
    was = f" (was v{before.version})" if before else " (the first)"
    if before is None or before.version != version:
        why = f"forced: {forced} ({run_id})" if forced else f"gated ({run_id})"
        check_version(registry.version(spec.name, version))  # its files are the ones the gate passed
        record = registry.promote(spec.name, version, reason=why, expected_generation=generation)
        generation = record.generation
    else:  # a rerun of a run that promoted already
        was, generation = " (already)", registry.generation(spec.name)
    champion = registry.version(spec.name, version)
    result = PromoteResult(version=version, generation=generation, watermark=champion.watermark,
                           summary=f"champion v{version}{was}, data up to {champion.watermark}")
    try:
        pointer = current(spec.inference.output_url)  # to put back if publishing fails
    except Exception:  # unreadable: publishing it will fail too, and say why
        pointer = None
    try:
        published = publish_outputs(spec, champion)
    except Exception as exc:  # the champion and its published outputs change together, or not at all
        raise _undo(spec, registry, before, version, pointer, run_id, exc) from exc
    result.published, result.summary = published[0], f"{result.summary}; {published[1]}"
    return result


def _undo(spec: JobSpec, registry: Registry, before: ModelVersion | None, version: int, pointer: dict | None,
          run_id: str, exc: Exception) -> FatalError:
    """Put the champion and the pointer back as they were after publishing `version` failed; the
    error to raise says what they are now."""
    if before is not None and before.version != version:
        registry.rollback(spec.name, reason=f"publishing v{version}'s outputs failed ({run_id})")
    if pointer is not None:  # a write that raised may still have landed
        with contextlib.suppress(Exception):
            open_store(spec.inference.output_url).write(CURRENT, json.dumps(pointer, indent=1).encode())
    if before is None:
        return FatalError(f"v{version}'s outputs could not be published ({exc}); v{version} is the first champion, "
                          "so nothing was rolled back: the next run of the spec publishes them once the output "
                          "location can be written")
    return FatalError(f"v{version}'s outputs could not be published ({exc}); the champion is v{before.version} "
                      "again and `current` is unchanged")


def repair_publication(spec: JobSpec) -> None:
    """Point `current` at the champion's outputs if its run was cut short between promoting it and
    publishing them (run under the model's lock, before anything else)."""
    assert spec.registry_url is not None
    champion = Registry(spec.registry_url).champion(spec.name)
    if champion is not None and unpublished(spec, champion):
        publish_outputs(spec, champion)
        get_run_logger().info("published the outputs of champion v%d, which its own run wrote but did not publish",
                              champion.version)


def publish_outputs(spec: JobSpec, champion: ModelVersion, folder: str | None = None) -> tuple[str, str]:
    """Point `current` at the champion's outputs (`folder`, by default its newest complete one):
    the manifest's URL and what was published."""
    output_url = spec.inference.output_url
    pointer = point_current(output_url, spec.name, champion.version, folder)
    manifest = join(output_url, pointer["folder"], MANIFEST)
    _artifacts.link(spec, "embeddings", manifest, f"{pointer['rows']} rows of champion v{champion.version} in "
                    f"{pointer['shards']} Parquet shard(s), published as current; its manifest")
    return manifest, f"{pointer['rows']} rows published"


def unpublished(spec: JobSpec, champion: ModelVersion) -> bool:
    """Whether the champion has complete outputs that `current` does not point at yet (a run cut
    short between its promotion and its publication)."""
    pointer = current(spec.inference.output_url)
    if pointer is not None and pointer.get("version") == champion.version:
        return False
    return latest_folder(spec.inference.output_url, champion.version) is not None
