"""Stage 2: collective tests between the cores, in the style of nccom-test."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.errors import FatalError
from trnflow.reporting.report import collectives_markdown
from trnflow.results import CollectivesResult
from trnflow.specs import JobSpec, PreflightSpec
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import run_job
from trnflow.teams import Team


@task(name="collectives", cache_policy=NO_CACHE)
def collective_test(spec: JobSpec, run_id: str, cores: list[int],
                    swept: CollectivesResult | None = None, *, team: Team | None = None) -> CollectivesResult:
    """All-reduce sweep across the verified cores, every result checked; enforces the spec's
    bus-bandwidth and latency thresholds.

    Args:
        swept: the sweep the sanity job already ran between these cores; without it, a job sweeps.
        team: the run's team (`StageRunner.team`), whose job it is; None: decided here.

    Raises:
        FatalError: wrong results (naming the cores that sent corrupted data), or a threshold missed.
    """
    result = run_job(spec, "collectives", run_id, cores=cores, team=team) if swept is None else swept
    assert isinstance(result, CollectivesResult)
    if not result.passed:
        raise FatalError(result.note or "wrong collective results", bad_cores=result.bad_cores)
    if swept is not None:
        get_run_logger().info("the sanity job swept the links between the same %d core(s): no job of its own",
                              swept.ranks)
    if result.avg_busbw is None:
        result.summary = result.note or "skipped"
        return result
    _artifacts.markdown(spec, "collectives", collectives_markdown(result), "nccom-test-style collective sweep")
    busbw, latency = check_thresholds(spec.preflight, result)
    result.summary = f"all_reduce ok on {result.ranks} cores, busbw {busbw:.3f} GB/s, {latency:.0f} us min"
    if result.source != "trnflow":
        result.summary += f" ({result.source})"
    return result


def check_thresholds(pf: PreflightSpec, result: CollectivesResult) -> tuple[float, float]:
    """The all-reduce bus bandwidth (GB/s) and smallest-size latency (us) of a sweep; FatalError
    when either misses the spec's threshold."""
    allreduce = [r for r in result.rows if r.op == "all_reduce"]
    busbw = result.avg_busbw_by_op["all_reduce"]
    latency = min(allreduce, key=lambda r: r.size).time_us
    if pf.min_busbw_gbps is not None and busbw < pf.min_busbw_gbps:
        raise FatalError(f"all_reduce bus bandwidth {busbw:.3f} GB/s is below preflight.min_busbw_gbps "
                         f"({pf.min_busbw_gbps}); a link is slow: check the instance's interconnect")
    if pf.max_latency_us is not None and latency > pf.max_latency_us:
        raise FatalError(f"the smallest all_reduce took {latency:.0f} us, above preflight.max_latency_us "
                         f"({pf.max_latency_us})")
    return busbw, latency
