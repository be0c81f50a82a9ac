"""The parity reference: the spec trained in plain fp32, the way a GPU run of the same job would be.

Its metric series, written to `gate.reference`, is what the evaluation gate compares a candidate
with. Same seed, same data order and same global batches as the candidate; only the numerics
(precision) are fixed to fp32.
"""

from __future__ import annotations

from collections.abc import Callable

from jobspecs import JobSpec
from trnflow.backends import JobRequest, JobState, backend_for, run_to_end
from trnflow.errors import FatalError
from trnflow.fsutil import atomic_write_json
from trnflow.gate import metrics_document
from trnflow.settings import TrnflowSettings
from trnflow.storage import local_path

RUN_ID = "reference"


def reference_spec(spec: JobSpec) -> JobSpec:
    """The spec in fp32, checkpointing beside the reference metrics file."""
    if spec.gate.reference is None:
        raise FatalError("gate.reference is not set; name the metrics file the reference run should write")
    folder = local_path(spec.gate.reference).parent / "checkpoints"
    return spec.model_copy(update={
        "compute": spec.compute.model_copy(update={"precision": "fp32"}),
        "train": spec.train.model_copy(update={"checkpoint_url": folder.as_uri()}),
    })


def run_reference(spec: JobSpec, settings: TrnflowSettings | None = None,
                  on_logs: Callable[[str], None] | None = None) -> dict:
    """Train and evaluate the reference; write its metrics to `gate.reference`. Returns the document."""
    settings = settings or TrnflowSettings()
    ref = reference_spec(spec)
    backend = backend_for(ref, settings)

    run_id = f"{RUN_ID}-{spec.digest()[:12]}"  # a changed spec never resumes an old reference

    def run(phase: str, checkpoint: str | None = None) -> dict:
        job_id, info = run_to_end(backend, JobRequest(ref, phase, run_id, checkpoint=checkpoint),
                                  settings.poll_seconds, on_logs=on_logs)
        if info.state is not JobState.SUCCEEDED or info.result is None:
            failure = info.failure or {}
            raise FatalError(f"reference {phase} job {job_id} failed: {failure.get('type')}: {failure.get('message')}")
        return info.result

    trained = run("train")
    evaluated = run("evaluate", trained["checkpoint"])
    document = {**metrics_document(evaluated["points"], source="fp32-reference"),
                "checkpoint": trained["checkpoint"]}
    assert spec.gate.reference is not None
    atomic_write_json(local_path(spec.gate.reference), document)
    return document
