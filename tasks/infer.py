"""Stage 6: offline batch inference, embeddings written as Parquet shards."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from trnflow.results import InferResult
from trnflow.specs import JobSpec
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import recompile_note, run_job
from trnflow.workload.embeddings import staging_url


@task(name="infer", cache_policy=NO_CACHE)
def batch_infer(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None, *, staged: bool = False
                ) -> InferResult:
    """Embed the inference set with the checkpoint; one Parquet shard per `inference.shard_size` rows.
    A retry (or rerun) keeps the shards already committed and embeds only the rest.

    Args:
        staged: embed into this run's staging folder under the output (a candidate that is not
            champion yet); the promote stage publishes it.
    """
    if staged:
        where = spec.inference.model_copy(update={"output_url": staging_url(spec.inference.output_url, run_id)})
        spec = spec.model_copy(update={"inference": where})
    result = run_job(spec, "infer", run_id, checkpoint=checkpoint, cores=cores)
    assert isinstance(result, InferResult)
    reused = f", {result.shards_reused} reused" if result.shards_reused else ""
    result.summary = (f"{result.rows} {result.published} in {len(result.shards)} shard(s){reused}, "
                      f"{result.rows_per_s:.0f} rows/s{recompile_note(result)}"
                      + (", staged until promotion" if staged else ""))
    if not staged and result.manifest:
        _artifacts.link(spec, "embeddings", result.manifest, f"{result.rows} {result.published} in "
                        f"{len(result.shards)} Parquet shard(s) under {result.output_url}")
    return result
