"""Offline batch inference on its own: run the spec's inference set through a registered model
version (the champion by default) or a given checkpoint, writing Parquet shards. A rerun with the
same run id finishes an interrupted one without rewriting committed shards.

A registered version writes into its own output folder. The champion's outputs are published, so
they are never rewritten in place: its run writes a folder of its own beside them, and `current`
is moved to it once it is complete. A bare checkpoint writes to the output itself.
"""

from __future__ import annotations

from functools import partial

from prefect import flow

from trnflow.errors import FatalError
from trnflow.flows._params import SpecParam, ends_with_reason, first_name, name_run, resolve_spec
from trnflow.flows._stages import StageRunner, flow_run_id, run_stages
from trnflow.lifecycle.registry import ModelVersion, Registry
from trnflow.results import RunOutcome
from trnflow.specs import JobSpec
from trnflow.tasks.infer import batch_infer
from trnflow.tasks.promote import publish_outputs
from trnflow.workload.embeddings import version_folder

STAGES = ("infer",)


def _version(spec: JobSpec, model: str) -> tuple[Registry, ModelVersion]:
    """The registered version `model` names: "champion" or a version number."""
    if spec.registry_url is None:
        raise FatalError(f"model {model!r}: {spec.name} has no registry_url to find it in; pass `checkpoint`")
    registry = Registry(spec.registry_url)
    if model == "champion":
        found = registry.champion(spec.name)
        if found is None:
            raise FatalError(f"{spec.name} has no champion in {spec.registry_url}; pass a version or a checkpoint, "
                             "or train and gate a model first")
        return registry, found
    number = model.lower().removeprefix("v")
    if not number.isdigit():
        raise FatalError(f"model {model!r}: give `champion` or a version number (`trnflow models ls`)")
    return registry, registry.version(spec.name, int(number))


@flow(name="trnflow-batch-inference", flow_run_name=first_name("infer"), log_prints=True,
      validate_parameters=False)
@ends_with_reason
def batch_inference(spec: SpecParam = None, spec_url: str | None = None, checkpoint: str | None = None,
                    run_id: str | None = None, model: str = "champion") -> RunOutcome:
    """Run `data.inference` through a model into `inference.output_url`.

    Args:
        checkpoint: a checkpoint to use instead of a registered version (its outputs go to the
            output itself, unversioned).
        model: the registered version to use: `champion` or a version number.
    """
    spec = resolve_spec(spec, spec_url)
    registry, version = None, None
    if checkpoint is None:
        registry, version = _version(spec, model)
        checkpoint, label = version.checkpoint, f"v{version.version}"
    else:
        label = checkpoint
    name_run(spec, f"infer {spec.data.inference} with {label}")
    return run_stages(StageRunner(spec, run_id or flow_run_id()),
                      partial(_stages, checkpoint=checkpoint, version=version, registry=registry), STAGES)


def _stages(stage: StageRunner, checkpoint: str, version: ModelVersion | None, registry: Registry | None
            ) -> RunOutcome:
    if version is None:
        stage("infer", batch_infer, checkpoint, None, team=stage.team)
        return stage.outcome()
    assert registry is not None
    champion = registry.champion(stage.spec.name)
    published = champion is not None and champion.version == version.version
    # the champion's published outputs are never rewritten in place: a folder of this run's
    folder = f"{version_folder(version.version)}-{stage.run_id}" if published else None
    stage("infer", batch_infer, checkpoint, None, version=version.version, folder=folder, team=stage.team)
    if published:
        publish_outputs(stage.spec, version, folder)
    return stage.outcome()
