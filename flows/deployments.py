"""The deployments of every trnflow flow for a job spec: one definition, rendered two ways.

`trnflow serve` turns them into served deployments (schedules included) in one process
(`trnflow.flows.serving`); `trnflow prefect-yaml` writes them as `prefect.yaml` for `prefect deploy
--all` onto a process work pool.
Each deployment is named `<spec name>-<what it runs>` (`quickstart-retrain`) and carries the whole
spec as its `spec` parameter: the UI's run form opens filled with it, and its scheduled runs run
it. Editing the spec file changes the deployments when they are served or deployed again.
The retraining deployment runs on the spec's `schedule`, one run at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import Flow
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.deployments.runner import EntrypointType
from prefect.schedules import Cron

from trnflow.errors import TrnflowError
from trnflow.flows.batch_inference import batch_inference
from trnflow.flows.compile import compile_cache
from trnflow.flows.incremental_retrain import incremental_retrain
from trnflow.flows.pipeline import pipeline
from trnflow.flows.preflight import preflight
from trnflow.reporting.forecast import headline
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec

WORK_POOL = "trnflow"
"""The process work pool `prefect.yaml` deploys to."""


@dataclass(frozen=True)
class FlowEntry:
    """One flow as trnflow deploys it: the flow itself, from which its name and entrypoint come."""

    key: str
    """What `trnflow submit --deployment` calls it."""
    flow: Flow[..., Any]
    description: str
    scheduled: bool = False
    trains: bool = False
    """Its runs train: its served deployment's description carries the forecast (`trnflow plan`'s line)."""
    suffix: str = ""
    """What the deployment's name adds to the spec's name (the key's own words by default)."""

    @property
    def flow_name(self) -> str:
        return self.flow.name

    @property
    def entrypoint(self) -> str:
        """The flow as a module path (`trnflow.flows.pipeline:pipeline`): it loads wherever trnflow is
        installed, whatever folder the worker runs in."""
        return f"{self.flow.fn.__module__}:{self.flow.fn.__name__}"

    @property
    def deployment_suffix(self) -> str:
        return self.suffix or self.key


FLOWS = (
    FlowEntry("pipeline", pipeline,
              "All six stages: sanity, collectives, compile, train, evaluate (parity gate), infer.", trains=True),
    FlowEntry("preflight", preflight, "Known-answer tests on every NeuronCore, then collective tests between them."),
    FlowEntry("compile", compile_cache, "Ahead-of-time compilation into the persistent compile cache."),
    FlowEntry("incremental-retrain", incremental_retrain,
              "Retrain the champion on the days after its watermark; gate, embed, then promote.", scheduled=True,
              trains=True, suffix="retrain"),
    FlowEntry("batch-inference", batch_inference, "Embed the inference set with the champion, as Parquet shards.",
              suffix="infer"),
)
BY_KEY = {f.key: f for f in FLOWS}


def deployment_name(spec_name: str, key: str) -> str:
    """`quickstart`, `incremental-retrain` -> `quickstart-retrain`: the spec's name and what the
    deployment runs, short enough for the UI's list to show whole."""
    return f"{spec_name}-{BY_KEY[key].deployment_suffix}"


def upcoming_name(spec_name: str, entry: FlowEntry) -> str:
    """What `trnflow serve` names a scheduled run of `entry`'s deployment while it waits to start
    (`quickstart: retrain (scheduled)`), where the server names it at random; the run takes its own
    name as it starts (`quickstart: retrain`, then what it does)."""
    return f"{spec_name}: {entry.deployment_suffix} (scheduled)"


def full_name(key_or_name: str, spec_name: str) -> str:
    """`pipeline` -> `trnflow-pipeline/<spec name>-pipeline`; a `flow/deployment` name is kept as it is."""
    if "/" in key_or_name:
        return key_or_name
    if key_or_name not in BY_KEY:
        raise KeyError(f"--deployment {key_or_name!r}: choose one of {', '.join(BY_KEY)}, or give flow/deployment")
    return f"{BY_KEY[key_or_name].flow_name}/{deployment_name(spec_name, key_or_name)}"


def _overlay(base: dict[str, Any], written: dict[str, Any]) -> dict[str, Any]:
    return {**base, **{k: _overlay(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
                       for k, v in written.items()}}


def spec_parameter(spec: JobSpec, as_written: dict[str, Any] | None = None) -> dict[str, Any]:
    """The spec as a deployment's `spec` parameter: every field filled in, and where `as_written`
    (the file's own data) is given, its values as the file has them, so a relative location stays
    relative to the folder the flows run in."""
    filled = spec.model_dump(mode="json")
    return _overlay(filled, as_written) if as_written else filled


def definitions(spec: JobSpec, source: str, as_written: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One plain description per flow: name, entrypoint, parameters, schedules, concurrency, tags.
    `source` is where the spec was read, which each description names; `as_written`, see
    `spec_parameter`."""
    parameters = {"spec": spec_parameter(spec, as_written)}
    out = []
    for entry in FLOWS:
        item: dict[str, Any] = {
            "name": deployment_name(spec.name, entry.key), "flow_name": entry.flow_name,
            "entrypoint": entry.entrypoint, "description": f"{entry.description} Spec: {source}.",
            "parameters": parameters,
            "tags": ["trnflow", spec.name, entry.key], "schedules": [], "concurrency_limit": None,
        }
        if entry.scheduled:
            item["concurrency_limit"] = 1  # and the model's own lock, whatever starts the run
            if spec.schedule is not None:
                schedule = spec.schedule
                item["schedules"] = [{"cron": schedule.cron, "timezone": schedule.timezone}]
                item["description"] += f" Runs at `{schedule.cron}` ({schedule.timezone})."
        out.append(item)
    return out


def prefect_yaml(spec: JobSpec, source: str, as_written: dict[str, Any]) -> dict[str, Any]:
    """The `prefect.yaml` document for `prefect deploy --all` (run from the project root, whose
    folder the process worker then runs the flows in, and the spec's relative locations with them)."""
    deployments = []
    for item in definitions(spec, source, as_written):
        deployment = {
            "name": item["name"], "entrypoint": item["entrypoint"], "description": item["description"],
            "tags": item["tags"], "parameters": item["parameters"], "enforce_parameter_schema": True,
            "work_pool": {"name": WORK_POOL}, "schedules": [{**s, "active": True} for s in item["schedules"]],
        }
        if item["concurrency_limit"]:
            deployment["concurrency_limit"] = {"limit": item["concurrency_limit"], "collision_strategy": "ENQUEUE"}
        deployments.append(deployment)
    return {"name": "trnflow", "prefect-version": "3.8.8", "deployments": deployments}


def runner_deployments(spec: JobSpec, source: str) -> list[tuple[FlowEntry, Any]]:
    """The same deployments as Prefect runner deployments, each with its flow, for `trnflow serve`; those whose runs
    train say in their description what a run is forecast to take and cost, from the history as it
    is now (the run's first log line says it again when it starts)."""
    from trnflow.workload.memory import decided  # the layout the runs take: the recipe's model, torch

    try:
        line = headline(decided(spec), TrnflowSettings().home.expanduser().resolve())
    except TrnflowError as exc:  # a recipe this host cannot build: the runs say why; serving goes on
        line = f"forecast: none ({exc})"
    forecast = f" {line[:1].upper()}{line[1:]}."
    out = []
    for entry, item in zip(FLOWS, definitions(spec, source), strict=True):
        limit = item["concurrency_limit"]
        description = item["description"] + (forecast if entry.trains else "")
        out.append((entry, entry.flow.to_deployment(
            name=item["name"], description=description, parameters=item["parameters"], tags=item["tags"],
            paused=False,  # serving again resumes what stopping paused
            entrypoint_type=EntrypointType.MODULE_PATH, enforce_parameter_schema=True,
            schedules=[Cron(s["cron"], timezone=s["timezone"]) for s in item["schedules"]],
            concurrency_limit=ConcurrencyLimitConfig(limit=limit, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
            if limit else None,
        )))
    return out
