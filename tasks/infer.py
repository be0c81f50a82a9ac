"""Stage 6: offline batch inference, embeddings (or predictions) written as Parquet shards."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from trnflow.results import InferResult
from trnflow.specs import JobSpec
from trnflow.storage import join
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import recompile_note, run_job
from trnflow.teams import Team
from trnflow.workload.embeddings import version_url


@task(name="infer", cache_policy=NO_CACHE)
def batch_infer(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None, *, version: int | None = None,
                folder: str | None = None, team: Team | None = None) -> InferResult:
    """Embed the inference set with the checkpoint; one Parquet shard per `inference.shard_size` rows.
    A retry (or rerun) keeps the shards already committed and embeds only the rest.

    Args:
        version: the registered model version the checkpoint is: its outputs go to a folder of
            their own under the output (`trnflow.workload.embeddings`), published when that version
            is the champion. None (no registry): to the output itself.
        folder: the version's folder to write, when not its own (an on-demand run's).
        team: the run's team (`StageRunner.team`), whose job it is; None: decided here.
    """
    if version is not None:
        url = join(spec.inference.output_url, folder) if folder else version_url(spec.inference.output_url, version)
        where = spec.inference.model_copy(update={"output_url": url})
        spec = spec.model_copy(update={"inference": where})
    result = run_job(spec, "infer", run_id, checkpoint=checkpoint, cores=cores, team=team)
    assert isinstance(result, InferResult)
    reused = f", {result.shards_reused} reused" if result.shards_reused else ""
    result.summary = (f"{result.rows} {result.published} in {len(result.shards)} shard(s){reused}, "
                      f"{result.rows_per_s:.0f} rows/s{recompile_note(result)}"
                      + (f", v{version}'s outputs" if version is not None else ""))
    if version is None and result.manifest:
        _artifacts.link(spec, "embeddings", result.manifest, f"{result.rows} {result.published} in "
                        f"{len(result.shards)} Parquet shard(s); their manifest")
    return result
