"""The parity reference: the spec trained in plain fp32, the way a GPU run of the same job would be.

Its metric series, written to `gate.reference`, is what the evaluation gate compares a candidate
with. Same seed, same data order and same global batches as the candidate; only the numerics
(precision) are fixed to fp32. It compiles at optimisation level 1, the compiler's quickest: a GPU
run has no Neuron compiler, and the kernels a higher level generates would make the baseline's
steps faster, never its numbers different, at minutes of compiling a run (it trains once; its
graphs are not the candidate's, so the compile stage has not built them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from trnflow.backends import JobRequest, JobState, backend_for, run_to_end
from trnflow.errors import FatalError
from trnflow.lifecycle.gate import read_series
from trnflow.records import MetricSeries
from trnflow.results import TrainResult
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec, SpecError
from trnflow.storage import open_store
from trnflow.storage.datafiles import data_files

RUN_ID = "reference"


def reference_spec(spec: JobSpec) -> JobSpec:
    """The spec in fp32 at optimisation level 1, checkpointing beside the reference metrics file,
    without the candidate's deadline and budget (they bound the run, not the baseline it is judged by)."""
    if spec.gate.reference in (None, "champion"):
        raise FatalError("gate.reference is not a file; name the metrics file the reference run should write")
    if spec.compute.backend != "local" and not spec.gate.reference.startswith("s3://"):
        raise SpecError(spec.name, [f"gate.reference: {spec.gate.reference} is not on S3; the reference run on "
                                    f"{spec.compute.backend} writes it, and its checkpoints beside it, from hosts "
                                    "that cannot see this machine's files: name an s3:// metrics file"])
    folder = spec.gate.reference.rpartition("/")[0] + "/checkpoints"
    return spec.model_copy(update={
        "compute": spec.compute.model_copy(update={"precision": "fp32"}),
        "compile": spec.compile.model_copy(update={"optlevel": 1}),
        "train": spec.train.model_copy(update={"checkpoint_url": folder, "max_minutes": None}),
    })


def _data_digest(spec: JobSpec) -> str:
    """Which training files there are, and their sizes: a new partition makes a new reference run."""
    files = data_files(spec.data.train, spec.data.format, spec.data.ready_marker)
    sizes = {(f.store.url, o.name): o.size for f in files for o in f.store.list(f.name)}
    listing = "\n".join(f"{f.url}\t{sizes.get((f.store.url, f.name), -1)}" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()[:8]


def run_reference(spec: JobSpec, settings: TrnflowSettings | None = None,
                  on_logs: Callable[[str], None] | None = None) -> MetricSeries:
    """Train the reference (it evaluates as it goes, at the candidate's steps); write its metric
    series to `gate.reference`. Returns the document."""
    settings = settings or TrnflowSettings()
    ref = reference_spec(spec)
    backend = backend_for(ref, settings)

    run_id = f"{RUN_ID}-{spec.digest()[:12]}-{_data_digest(spec)}"  # new spec or data: never an old reference's

    job_id, info = run_to_end(backend, JobRequest(ref, "train", run_id), settings.poll_seconds, on_logs=on_logs)
    if info.state is not JobState.SUCCEEDED or info.result is None:
        raise FatalError(f"reference training job {job_id} failed: {info.failed()}")
    trained = info.result
    assert isinstance(trained, TrainResult)
    if trained.checkpoint is None:
        raise FatalError(f"reference training job {job_id} trained nothing: {trained.reason}")
    series = read_series(trained.checkpoint.rpartition("/")[0])
    if series is None:
        raise FatalError(f"reference training job {job_id} wrote no metric series beside {trained.checkpoint}")
    document = series.model_copy(update={"source": "fp32-reference", "checkpoint": trained.checkpoint})
    assert spec.gate.reference is not None and spec.gate.reference != "champion"
    base, _, name = spec.gate.reference.rpartition("/")
    open_store(base).write(name, document.model_dump_json(indent=1, exclude_none=True).encode())
    return document
