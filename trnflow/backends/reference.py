"""The parity reference: the spec trained in plain fp32, the way a GPU run of the same job would be.

Its metric series, written to `gate.reference`, is what the evaluation gate compares a candidate
with. Same seed, same data order and same global batches as the candidate; only the numerics
(precision) are fixed to fp32. It compiles at optimisation level 1, the compiler's quickest: a GPU
run has no Neuron compiler, and the kernels a higher level generates would make the baseline's
steps faster, never its numbers different, at minutes of compiling a run (it trains once; its
graphs are not the candidate's, so the compile stage has not built them).
"""

from __future__ import annotations

from collections.abc import Callable

from trnflow.backends import JobRequest, JobState, backend_for, run_to_end
from trnflow.errors import FatalError
from trnflow.lifecycle.gate import read_series
from trnflow.lifecycle.references import reference_key, reference_url
from trnflow.records import MetricSeries
from trnflow.results import TrainResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec, SpecError
from trnflow.storage import open_store

RUN_ID = "reference"


def reference_spec(spec: JobSpec, url: str | None = None) -> JobSpec:
    """The spec in fp32 at optimisation level 1, compiling its graphs as it meets them (no
    recompilation limit: the compile stage built the candidate's, not these), checkpointing beside
    the reference metrics file (`url`, by default `reference_url`: gate.reference's file, or with
    `auto` its place under the spec's checkpoints), without the candidate's deadline and budget
    (they bound the run, not the baseline it is judged by)."""
    url = url or reference_url(spec)
    if url is None:
        raise FatalError("gate.reference is not a file; name the metrics file the reference run should write, or "
                         "set it to auto")
    if spec.compute.backend != "local" and not url.startswith("s3://"):
        raise SpecError(spec.name, [f"gate.reference: {url} is not on S3; the reference run on "
                                    f"{spec.compute.backend} writes it, and its checkpoints beside it, from hosts "
                                    "that cannot see this machine's files: name an s3:// metrics file"])
    return spec.model_copy(update={
        "compute": spec.compute.model_copy(update={"precision": "fp32"}),
        "compile": spec.compile.unlimited().model_copy(update={"optlevel": 1}),
        "train": spec.train.model_copy(update={"checkpoint_url": url.rpartition("/")[0] + "/checkpoints",
                                               "max_minutes": None}),
    })


def keep_reference(spec: JobSpec, trained: TrainResult, job: str, url: str | None = None) -> MetricSeries:
    """The reference training's metric series, written where the gate reads it (`url`, by default
    `reference_url`), marked as the fp32 reference with the checkpoint it ended on. Returns the
    document."""
    if trained.checkpoint is None:
        raise FatalError(f"reference training job {job} trained nothing: {trained.reason}")
    series = read_series(trained.checkpoint.rpartition("/")[0])
    if series is None:
        raise FatalError(f"reference training job {job} wrote no metric series beside {trained.checkpoint}")
    document = series.model_copy(update={"source": "fp32-reference", "checkpoint": trained.checkpoint})
    url = url or reference_url(spec)
    assert url is not None
    base, _, name = url.rpartition("/")
    open_store(base).write(name, document.model_dump_json(indent=1, exclude_none=True).encode())
    return document


def run_reference(spec: JobSpec, settings: TrnflowSettings | None = None,
                  on_logs: Callable[[str], None] | None = None) -> MetricSeries:
    """Train the reference (it evaluates as it goes, at the candidate's steps) as a job of its own,
    and write its metric series where the gate reads it. Returns the document. Its run id names
    what decides its numbers (`reference_key`): a new spec or new data never resumes an old one."""
    settings = settings or TrnflowSettings()
    key = reference_key(spec)  # the data listed once: its run id and (with auto) its place agree
    url = reference_url(spec, key)
    ref = reference_spec(spec, url)
    job_id, info = run_to_end(backend_for(ref, settings), JobRequest(ref, "train", f"{RUN_ID}-{key}"),
                              settings.poll_seconds, on_logs=on_logs)
    if info.state is not JobState.SUCCEEDED or info.result is None:
        raise FatalError(f"reference training job {job_id} failed: {info.failed()}")
    assert isinstance(info.result, TrainResult)
    return keep_reference(spec, info.result, job_id, url)
