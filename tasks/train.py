"""Stage 4: training from a checkpoint, resumed exactly when a retry follows a transient failure.

A hardware error names the cores at fault; they are recorded for the run, and every later attempt
runs on other cores (resuming from the checkpoint like any retry).
"""

from __future__ import annotations

import json
import time

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, State

from trnflow.backends import keeps_instance
from trnflow.errors import HardwareError
from trnflow.fsutil import atomic_write_json
from trnflow.reporting.budget import attempt_allowance
from trnflow.reporting.chart import training_png
from trnflow.reporting.cost import stage_cost
from trnflow.reporting.ledger import JobLedger
from trnflow.reporting.report import loss_figure
from trnflow.results import TrainResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec
from trnflow.specs.instances import instance
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import recompile_note, run_job
from trnflow.teams import Team


def _bad_cores_file(run_id: str):
    return TrnflowSettings().home.expanduser().resolve() / "runs" / run_id / "bad-cores.json"


def bad_cores(run_id: str) -> set[int]:
    """The cores earlier attempts of this run found at fault."""
    path = _bad_cores_file(run_id)
    return set(json.loads(path.read_text())) if path.is_file() else set()


def _on_the_cores_left(spec: JobSpec, avoid: set[int], logger) -> JobSpec:
    """The spec for an attempt on the healthy cores its instance has left, when they are fewer than
    it asks for and train.parallelism.min_cores_per_node allows it; on a backend whose retry runs on
    the same instance (a cloud retry gets new instances with every core)."""
    if not keeps_instance(spec):
        return spec
    total = instance(spec.compute.instance_type).cores
    healthy = total - len({c for c in avoid if c < total})
    fewer = spec.on_fewer_cores(healthy)
    if fewer is None:
        return spec
    logger.warning("%s has %d healthy NeuronCore(s) left; this attempt trains on %d of them instead of %d "
                   "(train.parallelism.min_cores_per_node) and resumes resharded", spec.compute.instance_type,
                   healthy, fewer.compute.cores_per_node, spec.compute.cores_per_node)
    return fewer


def _budget_left(spec: JobSpec, budget_usd: float | None, run_id: str, ledger_mark: int, logger) -> float | None:
    """What this attempt may cost (`attempt_allowance`): the stage's `budget_usd` less what the jobs
    the run's ledger recorded after `ledger_mark` cost."""
    if budget_usd is None:
        return None
    billed = JobLedger(TrnflowSettings().home, run_id, start=ledger_mark).new_entries()
    spent = stage_cost(spec, "train", billed).cost_usd if billed else None
    left = attempt_allowance(budget_usd, spent)
    if spent:
        logger.info("budget: this attempt may cost $%.4f (earlier attempts cost $%.4f)", left, spent)
    return left


@task(name="train", cache_policy=NO_CACHE)
def train_model(spec: JobSpec, run_id: str, cores: list[int], ledger_mark: int = 0, budget_usd: float | None = None,
                *, team: Team | None = None) -> TrainResult | State:
    """Train on every core with DDP. A retry of the same run resumes from its newest checkpoint;
    its budget is what the attempts before it left of `budget_usd` (the run's allowance for
    training, `training_budget`; None: no limit; `ledger_mark`: where the run's ledger stood when
    the stage began). Its jobs are `team`'s (`StageRunner.team`; None: decided here).

    Returns:
        The train result; `checkpoint` is the URL of the final checkpoint. With no new data
        (`data.window: since-watermark`) the task ends Completed, named Skipped.
    """
    began, logger = time.monotonic(), get_run_logger()
    budget = _budget_left(spec, budget_usd, run_id, ledger_mark, logger)
    avoid = bad_cores(run_id)
    placement: dict = {"cores": cores}
    attempt = spec
    if avoid & set(cores):
        placement = {"exclude_cores": avoid}
        logger.warning("NeuronCore(s) %s failed in an earlier attempt; this attempt runs on other cores",
                       sorted(avoid))
        attempt = _on_the_cores_left(spec, avoid, logger)
    try:
        result = run_job(attempt, "train", run_id, **placement, team=team, budget_usd=budget)
    except HardwareError as exc:
        atomic_write_json(_bad_cores_file(run_id), sorted(avoid | set(exc.bad_cores)))
        raise
    assert isinstance(result, TrainResult)
    result.task_seconds = round(time.monotonic() - began, 3)
    if result.skipped:
        result.summary = f"skipped: {result.reason}"
        return Completed(name="Skipped", message=result.summary, data=result)
    if result.curve:
        png = training_png(result.curve, result.evaluations, spec.gate.metric, f"{spec.name} {run_id}")
        _artifacts.image(spec, "training", png, "training loss and holdout metric against global step")
    resumed = f", resumed at step {result.start_step}" if result.resumed_from else ""
    notes = "".join(f"; slow: {s}" for s in result.slow_ranks) + "".join(f"; rolled back {r}" for r in result.rollbacks)
    result.summary = (f"{result.steps_trained} steps, {loss_figure(result)}, "
                      f"{result.samples_per_s:.0f} samples/s{resumed}{recompile_note(result)}{notes}")
    return result
