"""What a case produced, compared with the fault-free run; and what recovering cost it."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq
import torch

from trnflow.lifecycle.registry import Registry
from trnflow.specs import JobSpec
from trnflow.storage import open_store
from trnflow.workload.checkpoint import RunCheckpoints, load
from trnflow.workload.embeddings import current_url

_EVENT = re.compile(r"\{.*\"event\".*\}")


@dataclass
class Snapshot:
    """The final weights, the registry's view of the model, and the embeddings."""

    model: dict
    optim: dict
    registry: dict
    embeddings: dict[str, list[float]]
    committed: list[int]
    evaluations: list[dict]
    """The holdout metrics at each evaluation point of training."""

    @classmethod
    def of(cls, spec: JobSpec, checkpoint: str) -> Snapshot:
        ckpt = load(checkpoint)
        registry = Registry(spec.registry_url)
        champion = registry.champion(spec.name)
        keep = ("version", "status", "metrics", "watermark", "global_step")
        view = {"champion": champion and {k: getattr(champion.entry, k) for k in keep},
                "versions": len(registry.versions(spec.name)), "promotions": len(registry.history(spec.name))}
        out = open_store(current_url(spec.inference.output_url))
        rows: dict[str, list[float]] = {}
        for obj in out.list():
            if obj.name.endswith(".parquet") and "/" not in obj.name:
                table = pq.read_table(io.BytesIO(out.read(obj.name)))
                rows.update(zip(table.column("id").to_pylist(), table.column("embedding").to_pylist(), strict=True))
        run = RunCheckpoints(checkpoint.rpartition("/")[0])
        return cls(ckpt.model, ckpt.optim or {}, view, rows, run.committed(),
                   [p.model_dump() for p in ckpt.meta.evaluations] if ckpt.meta else [])

    def differences(self, base: Snapshot, rtol: float = 0.0, outputs_rtol: float | None = None) -> dict[str, bool]:
        """Which of weights, registry, outputs and checkpoints equal the fault-free run's: bitwise, or
        within `rtol` relative to each value's (each embedding's) largest magnitude (the embeddings
        within `outputs_rtol`, where it is given). Within `rtol`,
        the weights are compared by what they compute, every holdout metric at every evaluation point:
        a parameter whose gradient is zero but for rounding (an attention key bias) takes steps of the
        learning rate's size from AdamW whatever the rounding, so after a change of summation order it
        differs from the fault-free run's element by element while the model computes the same."""
        weights = _same(self.evaluations, base.evaluations, rtol) and bool(base.evaluations) if rtol else (
            _same(self.model, base.model, 0.0) and _same(self.optim, base.optim, 0.0))
        return {
            "weights": weights,
            "registry": _same(self.registry, base.registry, rtol),
            "outputs": _same(self.embeddings, base.embeddings, rtol if outputs_rtol is None else outputs_rtol)
            and bool(base.embeddings),
            "checkpoints": self.committed == base.committed,
        }


def _same(a, b, rtol: float) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return torch.equal(a, b) if not rtol else bool(
            (a.double() - b.double()).abs().max() <= rtol * max(b.double().abs().max().item(), 1e-30)) if a.numel() \
            else True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rtol) for k in a)
    if rtol and isinstance(a, list) and isinstance(b, list) and a and all(isinstance(x, float) for x in a + b):
        return _same(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64), rtol)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b, strict=True))
    if rtol and isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= rtol * max(abs(b), 1e-30)
    return a == b


@dataclass
class Cost:
    """What recovering took: retries by owner, and training steps done more than once."""

    retries: dict[str, int] = field(default_factory=dict)
    steps_redone: int = 0

    @property
    def total_retries(self) -> int:
        return sum(self.retries.values())


def events(text: str) -> list[dict]:
    found = []
    for match in _EVENT.finditer(text):
        try:
            found.append(json.loads(match.group(0)))
        except json.JSONDecodeError:
            continue
    return found


def steps_redone(attempt_logs: list[str], steps: int) -> tuple[int, int]:
    """Training steps done more than once, and how many attempts trained, from the training jobs'
    logs (oldest first; a cloud job's log may hold several attempts). An attempt starts at a
    `resume` event (from its step) or where the `train` events (one a step) go back."""
    spans: list[list[int]] = []
    for text in attempt_logs:
        current: list[int] | None = None
        start = 0
        for event in events(text):
            if event["event"] == "resume":
                current, start = None, event["step"]
            elif event["event"] == "train":
                if current is None or event["step"] <= current[1]:
                    current = [start, event["step"]]
                    spans.append(current)
                    start = 0
                current[1] = event["step"]
    return sum(last - first for first, last in spans) - steps, len(spans)


def local_train_logs(jobs_dir: Path, since: float) -> list[str]:
    """The logs of the local training jobs submitted since `since`, oldest first."""
    jobs = []
    for record in jobs_dir.glob("*/job.json"):
        job = json.loads(record.read_text())
        if job["phase"] == "train" and record.stat().st_mtime >= since:
            jobs.append((record.stat().st_mtime, (record.parent / "job.log").read_text(errors="replace")))
    return [text for _, text in sorted(jobs)]


@contextlib.contextmanager
def events_in_task_logs() -> Iterator[None]:
    """While the block runs, the tasks' relayed job events reach the runs' logs as JSON too (they
    are logged at DEBUG, beside their readable line): a cloud job's attempts are counted from them."""
    logger = logging.getLogger("prefect.task_runs")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        yield
    finally:
        logger.setLevel(level)


def prefect_runs(since: datetime) -> tuple[dict[str, int], list[str]]:
    """Task retries by task name, and the training tasks' relayed logs, of the flow runs started
    since `since`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterStartTime,
        LogFilter,
        LogFilterTaskRunId,
        TaskRunFilter,
    )
    from prefect.client.schemas.sorting import LogSort

    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(flow_run_filter=FlowRunFilter(start_time=FlowRunFilterStartTime(after_=since)))
        retries: dict[str, int] = {}
        train_runs = []
        for task_run in client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [f.id for f in flows]}),
                                              task_run_filter=TaskRunFilter()):
            name = task_run.name.split("-")[0]
            if task_run.run_count > 1:
                retries[name] = retries.get(name, 0) + task_run.run_count - 1
            if name == "train":
                train_runs.append(task_run.id)
        logs: list = []
        while train_runs:
            page = client.read_logs(log_filter=LogFilter(task_run_id=LogFilterTaskRunId(any_=train_runs)),
                                    sort=LogSort.TIMESTAMP_ASC, limit=200, offset=len(logs))
            logs += page
            if len(page) < 200:
                break
    return retries, ["\n".join(log.message for log in logs)]
