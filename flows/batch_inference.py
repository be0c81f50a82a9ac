"""Offline batch inference on its own: embed the spec's inference set with the registered champion
(or a given checkpoint), writing Parquet shards. A rerun with the same run id finishes an
interrupted one without rewriting committed shards."""

from __future__ import annotations

from prefect import flow

from trnflow.errors import FatalError
from trnflow.flows._params import name_run, resolve_spec
from trnflow.flows._stages import StageRunner, new_run_id
from trnflow.lifecycle.registry import Registry
from trnflow.results import RunOutcome
from trnflow.specs import JobSpec
from trnflow.tasks.infer import batch_infer

STAGES = ("infer",)


@flow(name="trnflow-batch-inference", log_prints=True)
def batch_inference(spec: JobSpec | None = None, spec_url: str | None = None, checkpoint: str | None = None,
                    run_id: str | None = None) -> RunOutcome:
    """Embed `data.inference` into `inference.output_url`.

    Args:
        checkpoint: the model to embed with; by default the champion of the spec's name.
    """
    spec = resolve_spec(spec, spec_url)
    label = checkpoint
    if checkpoint is None:
        champion = Registry(spec.registry_url).champion(spec.name) if spec.registry_url else None
        if champion is None:
            raise FatalError(f"{spec.name} has no champion{' in ' + spec.registry_url if spec.registry_url else ''}"
                             "; pass `checkpoint`, or train and gate a model first")
        checkpoint, label = champion.checkpoint, f"champion v{champion.version}"
    name_run(spec, f"embed {spec.data.inference} with {label}")
    stage = StageRunner(spec, run_id or new_run_id())
    try:
        stage("infer", batch_infer, checkpoint, None)
        return stage.outcome()
    finally:
        stage.report(STAGES)
