"""Preflight: hardware sanity checks on every core the job will use, then collective tests
between them. The pipeline's first two stages, runnable on their own (`trnflow preflight`)."""

from __future__ import annotations

from prefect import flow

from trnflow.flows._params import SpecParam, ends_with_reason, first_name, name_run, resolve_spec
from trnflow.flows._stages import StageRunner, flow_run_id, preflight_stages, run_stages
from trnflow.results import RunOutcome

STAGES = ("sanity", "collectives")


@flow(name="trnflow-preflight", flow_run_name=first_name("preflight"), log_prints=True,
      validate_parameters=False)
@ends_with_reason
def preflight(spec: SpecParam = None, spec_url: str | None = None, run_id: str | None = None) -> RunOutcome:
    """Check every engine of each core, then the links between them.

    A failure ends the run Failed, its message naming the bad core, the hung collective or the
    slow link; its data is the `PipelineFailed`.
    """
    spec = resolve_spec(spec, spec_url)
    compute = spec.compute
    name_run(spec, f"preflight of {compute.world_size} cores on {compute.nodes}x {compute.instance_type}")
    return run_stages(StageRunner(spec, run_id or flow_run_id()), _stages, STAGES)


def _stages(stage: StageRunner) -> RunOutcome:
    preflight_stages(stage)
    return stage.outcome()
