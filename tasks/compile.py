"""Stage 3: ahead-of-time compilation into the persistent compile cache."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.backends import cache_keys
from trnflow.device import plans
from trnflow.device.cache import COMPILER_VERSION, CompileCache, entry_name
from trnflow.measures import ProgramOutcome, ProgramPlan
from trnflow.reporting.report import compile_markdown
from trnflow.results import CompileResult
from trnflow.specs import JobSpec
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import run_job
from trnflow.teams import Team
from trnflow.workload.recipes import plan_digest


@task(name="compile", cache_policy=NO_CACHE)
def compile_graphs(spec: JobSpec, run_id: str, cores: list[int] | None, *, team: Team | None = None
                   ) -> CompileResult:
    """Say which graphs will hit the cache, then compile the ones it does not hold yet.

    When an earlier trial run recorded this spec's plan, the prediction comes before any job is
    launched, and a stage whose graphs are all in the cache launches none. The job, and the keys the
    cache is checked with, are `team`'s (`StageRunner.team`; None: decided here).

    Returns:
        Per-graph keys and what happened to each (`report`), with `hits` and `compiled` counts.
    """
    logger = get_run_logger()
    # The cache the jobs will open: every backend gives them NEURON_CC_FLAGS and NEURON_COMPILE_CACHE_URL
    # made from compile.cache_url (neuron_env, the cloud request builders), so it is resolved from the
    # spec alone, whatever this process's own environment says.
    cache = plans.job_cache(spec, env={}, keys=cache_keys(spec, team=team))  # checked with the key the jobs check with
    known = plans.recorded(cache, plan_digest(spec))
    if known is None:
        logger.info("no compile plan recorded in %s for this spec yet; the compile job extracts it", cache.url)
    else:
        prediction = plans.predict(known, cache, retry_failed=False)
        for row in prediction:
            logger.info("before launch: %s (%s) %s is %s; will %s", row.program, row.shapes, row.key, row.state,
                        row.will)
        if all(row.will == "hit" for row in prediction):
            result = _all_hits(spec, cache, prediction)
            _artifacts.markdown(spec, "compile", compile_markdown(result), "compile cache hits and misses")
            return result
    result = run_job(spec, "compile", run_id, processes=1, cores=cores[:1] if cores else None, team=team)
    assert isinstance(result, CompileResult)
    compiled = f", {result.compiled} compiled in {result.seconds:.1f}s" if result.compiled else ""
    result.summary = f"{len(result.programs)} programs: {result.hits} cache hit(s){compiled}"
    _artifacts.markdown(spec, "compile", compile_markdown(result), "compile cache hits and misses")
    return result


def _all_hits(spec: JobSpec, cache: CompileCache, prediction: list[ProgramPlan]) -> CompileResult:
    for row in prediction:
        cache.record_hit(entry_name(row.key))
    report = {row.key: ProgramOutcome(program=row.program, key=row.key, status="hit") for row in prediction}
    return CompileResult(programs=prediction, graphs=len(prediction), compiler=COMPILER_VERSION, cache=cache.url,
                         hits=len(prediction), report=report, launched=False,
                         summary=f"{len(prediction)} programs: {len(prediction)} cache hit(s), known before launch")
