"""Ahead-of-time compilation on its own: fill the persistent compile cache for a spec before its
training runs, as neuron_parallel_compile does (`trnflow compile` runs the same job directly)."""

from __future__ import annotations

from prefect import flow

from trnflow.flows._params import SpecParam, name_run, refuses_bad_specs, resolve_spec
from trnflow.flows._stages import StageRunner, new_run_id
from trnflow.results import RunOutcome
from trnflow.tasks.compile import compile_graphs

STAGES = ("compile",)


@flow(name="trnflow-compile", log_prints=True, validate_parameters=False)
@refuses_bad_specs
def compile_cache(spec: SpecParam | None = None, spec_url: str | None = None) -> RunOutcome:
    """Compile every program of the spec that the cache does not hold yet.

    Raises:
        PipelineFailed: a compiler error (never retried: the same graph fails the same way).
    """
    spec = resolve_spec(spec, spec_url)
    name_run(spec, f"compile at -O{spec.compile.optlevel} into {spec.compile.cache_url}")
    stage = StageRunner(spec, new_run_id())
    try:
        stage("compile", compile_graphs, None)
        return stage.outcome()
    finally:
        stage.report(STAGES)
