"""The quickstart spec in a scratch folder, with its own data, for the benchmarks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from trnflow.backends import JobRequest, JobState, wait
from trnflow.backends.local import LocalBackend
from trnflow.specs import JobSpec, validate_spec
from trnflow.workload.synth import synthesize

EXAMPLE = Path(__file__).resolve().parents[1] / "jobspecs" / "examples" / "quickstart.yaml"


def scratch_home(root: Path) -> None:
    """Job folders, core leases and Prefect's database under `root`, so a benchmark leaves nothing
    behind."""
    os.environ["TRNFLOW_HOME"] = str(root / "trnflow-home")
    os.environ.setdefault("TRNFLOW_NEURON_RT_DIR", str(root / "rt"))
    os.environ["PREFECT_HOME"] = str(root / "prefect-home")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # A new home's temporary server first builds its database, which can take longer than Prefect's
    # 20 s on a busy 2-core machine; the same allowance as the `trnflow` command gives it.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def run_job(backend: LocalBackend, spec: JobSpec, phase: str, run_id: str, checkpoint: str | None = None,
            cores: tuple[int, ...] | None = None) -> dict:
    """Run one phase through the local backend (on `cores`, or wherever it places the job) and
    return its result as JSON data; a failed job ends the benchmark."""
    info = wait(backend, backend.submit(JobRequest(spec, phase, run_id, checkpoint=checkpoint, cores=cores)), 0.1)
    if info.state is not JobState.SUCCEEDED:
        raise SystemExit(f"{phase} job {run_id} failed: {info.failed()}")
    assert info.result is not None
    return info.result.model_dump(mode="json")


def quickstart(root: Path, **sections: Any) -> JobSpec:
    """The quickstart example with its data under `root/data` (made on first use) and every output
    under `root`; `sections` update the example's sections."""
    data = root / "data"
    if not (data / "holdout").exists():
        synthesize(data, days=2, rows_per_day=800, seed=7)
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["data"] = {**raw["data"], "train": str(data / "train"), "holdout": str(data / "holdout"),
                   "inference": str(data / "inference")}
    raw["train"]["checkpoint_url"] = str(root / "checkpoints")
    raw["inference"]["output_url"] = str(root / "embeddings")
    raw["gate"]["reference"] = None
    raw["registry_url"] = str(root / "registry")
    for name, values in sections.items():  # a section's values update it; anything else (faults) replaces
        raw[name] = {**raw.get(name, {}), **values} if isinstance(values, dict) else values
    return validate_spec(raw)
