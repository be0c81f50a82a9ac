"""Preflight: hardware sanity checks on every core the job will use, then collective tests
between them. The pipeline's first two stages, runnable on their own (`trnflow preflight`)."""

from __future__ import annotations

from prefect import flow

from trnflow.flows._params import SpecParam, name_run, refuses_bad_specs, resolve_spec
from trnflow.flows._stages import StageRunner, new_run_id, preflight_stages
from trnflow.results import RunOutcome

STAGES = ("sanity", "collectives")


@flow(name="trnflow-preflight", log_prints=True, validate_parameters=False)
@refuses_bad_specs
def preflight(spec: SpecParam | None = None, spec_url: str | None = None, run_id: str | None = None) -> RunOutcome:
    """Check every engine of each core, then the links between them.

    Raises:
        PipelineFailed: naming the bad core, the hung collective or the slow link.
    """
    spec = resolve_spec(spec, spec_url)
    compute = spec.compute
    name_run(spec, f"preflight of {compute.world_size} cores on {compute.nodes}x {compute.instance_type}")
    stage = StageRunner(spec, run_id or new_run_id())
    try:
        preflight_stages(stage)
        return stage.outcome()
    finally:
        stage.report(STAGES)
