"""The deployments of every trnflow flow for a job spec: one definition, rendered two ways.

`trnflow serve` turns them into served deployments (schedules included) in one process; `trnflow
prefect-yaml` writes them as `prefect.yaml` for `prefect deploy --all` onto a process work pool.
Each deployment is named after the spec and reads it from `spec_url` unless a run passes `spec`.
The retraining deployment runs on the spec's `schedule`, one run at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.schedules import Cron

from trnflow.flows.batch_inference import batch_inference
from trnflow.flows.compile import compile_cache
from trnflow.flows.incremental_retrain import incremental_retrain
from trnflow.flows.pipeline import pipeline
from trnflow.flows.preflight import preflight
from trnflow.specs import JobSpec

WORK_POOL = "trnflow"
"""The process work pool `prefect.yaml` deploys to."""


@dataclass(frozen=True)
class FlowEntry:
    key: str
    """What `trnflow submit --deployment` calls it."""
    flow_name: str
    entrypoint: str
    description: str
    scheduled: bool = False


FLOWS = (
    FlowEntry("pipeline", "trnflow-pipeline", "flows/pipeline.py:pipeline",
              "All six stages: sanity, collectives, compile, train, evaluate (parity gate), infer."),
    FlowEntry("preflight", "trnflow-preflight", "flows/preflight.py:preflight",
              "Known-answer tests on every NeuronCore, then collective tests between them."),
    FlowEntry("compile", "trnflow-compile", "flows/compile.py:compile_cache",
              "Ahead-of-time compilation into the persistent compile cache."),
    FlowEntry("incremental-retrain", "trnflow-incremental-retrain", "flows/incremental_retrain.py:incremental_retrain",
              "Retrain the champion on the days after its watermark; gate, embed, then promote.", scheduled=True),
    FlowEntry("batch-inference", "trnflow-batch-inference", "flows/batch_inference.py:batch_inference",
              "Embed the inference set with the champion, as Parquet shards."),
)
BY_KEY = {f.key: f for f in FLOWS}


def full_name(key_or_name: str, spec_name: str) -> str:
    """`pipeline` -> `trnflow-pipeline/<spec name>`; a `flow/deployment` name is kept as it is."""
    if "/" in key_or_name:
        return key_or_name
    if key_or_name not in BY_KEY:
        raise KeyError(f"--deployment {key_or_name!r}: choose one of {', '.join(BY_KEY)}, or give flow/deployment")
    return f"{BY_KEY[key_or_name].flow_name}/{spec_name}"


def definitions(spec: JobSpec, spec_url: str) -> list[dict[str, Any]]:
    """One plain description per flow: name, entrypoint, parameters, schedules, concurrency, tags."""
    out = []
    for entry in FLOWS:
        item: dict[str, Any] = {
            "name": spec.name, "flow_name": entry.flow_name, "entrypoint": entry.entrypoint,
            "description": entry.description, "parameters": {"spec_url": spec_url},
            "tags": ["trnflow", spec.name, entry.key], "schedules": [], "concurrency_limit": None,
        }
        if entry.scheduled:
            item["concurrency_limit"] = 1  # and the model's own lock, whatever starts the run
            if spec.schedule is not None:
                item["schedules"] = [{"cron": spec.schedule.cron, "timezone": spec.schedule.timezone}]
        out.append(item)
    return out


def prefect_yaml(spec: JobSpec, spec_url: str) -> dict[str, Any]:
    """The `prefect.yaml` document for `prefect deploy --all` (run from the project root, whose
    folder the process worker then runs the flows in)."""
    deployments = []
    for item in definitions(spec, spec_url):
        deployment = {
            "name": item["name"], "entrypoint": item["entrypoint"], "description": item["description"],
            "tags": item["tags"], "parameters": item["parameters"], "work_pool": {"name": WORK_POOL},
            "schedules": [{**s, "active": True} for s in item["schedules"]],
        }
        if item["concurrency_limit"]:
            deployment["concurrency_limit"] = {"limit": item["concurrency_limit"], "collision_strategy": "ENQUEUE"}
        deployments.append(deployment)
    return {"name": "trnflow", "prefect-version": "3.8.8", "deployments": deployments}


def runner_deployments(spec: JobSpec, spec_url: str) -> list[Any]:
    """The same deployments as Prefect runner deployments, for `prefect.serve`."""
    flows = {"trnflow-pipeline": pipeline, "trnflow-preflight": preflight, "trnflow-compile": compile_cache,
             "trnflow-incremental-retrain": incremental_retrain, "trnflow-batch-inference": batch_inference}
    out = []
    for item in definitions(spec, spec_url):
        limit = item["concurrency_limit"]
        out.append(flows[item["flow_name"]].to_deployment(
            name=item["name"], description=item["description"], parameters=item["parameters"], tags=item["tags"],
            schedules=[Cron(s["cron"], timezone=s["timezone"]) for s in item["schedules"]],
            concurrency_limit=ConcurrencyLimitConfig(limit=limit, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
            if limit else None,
        ))
    return out


def serve_all(specs: list[tuple[JobSpec, str]], limit: int | None = None) -> None:
    """Serve every flow's deployment for each (spec, spec_url) from this process until stopped."""
    serve(*[d for spec, url in specs for d in runner_deployments(spec, url)], limit=limit,
          print_starting_message=False)
