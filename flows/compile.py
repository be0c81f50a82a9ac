"""Ahead-of-time compilation on its own: fill the persistent compile cache for a spec before its
training runs, as neuron_parallel_compile does (`trnflow compile` runs the same job directly)."""

from __future__ import annotations

from prefect import flow

from trnflow.flows._params import SpecParam, ends_with_reason, first_name, name_run, resolve_spec
from trnflow.flows._stages import StageRunner, flow_run_id, run_stages
from trnflow.results import RunOutcome
from trnflow.tasks.compile import compile_graphs

STAGES = ("compile",)


@flow(name="trnflow-compile", flow_run_name=first_name("compile"), log_prints=True,
      validate_parameters=False)
@ends_with_reason
def compile_cache(spec: SpecParam = None, spec_url: str | None = None) -> RunOutcome:
    """Compile every program of the spec that the cache does not hold yet.

    A compiler error (never retried: the same graph fails the same way) ends the run Failed, its
    message naming it; its data is the `PipelineFailed`.
    """
    spec = resolve_spec(spec, spec_url)
    name_run(spec, f"compile at -O{spec.compile.optlevel} into {spec.compile.cache_url}")
    return run_stages(StageRunner(spec, flow_run_id()), _stages, STAGES)


def _stages(stage: StageRunner) -> RunOutcome:
    stage.check_cache("before compiling")
    stage("compile", compile_graphs, None, team=stage.team)
    return stage.outcome()
