"""The JSON lines a job's ranks print (`WorkloadContext.log`: `{"ts", "event", "rank", ...}`), as a
person reads them in a flow run's log: `train: step 10/300, mean loss 0.3760, 1,234 samples/s`.
The JSON itself stays in the job's own log file (and at DEBUG in the run's log)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

EVENT_FIELD = "trnflow_event"
"""The log record attribute that carries a relayed line's event (for the CLI's progress bars)."""

_NOT_SHOWN = frozenset({"ts", "event", "rank"})
_LONG = 160  # a value longer than this (a list of shapes, a URL list) is cut


_COMPILE_SUMMARY = "INFO ||NEURON_PARALLEL_COMPILE||: {"
"""neuron_parallel_compile's summary line (`{"compilation_summary": {...}, "compilation_report": {...}}`),
which the compile phase prints as the tool does."""


def parse_event(line: str) -> dict[str, Any] | None:
    """The event a line holds, or None for any other output (a library's warning, a traceback).
    neuron_parallel_compile's summary line is the event `compile_summary` (its counts)."""
    text = line[len(_COMPILE_SUMMARY) - 1:] if line.startswith(_COMPILE_SUMMARY) else line
    if not text.startswith("{"):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    if text is not line:
        summary = record.get("compilation_summary")
        return {"event": "compile_summary", **summary} if isinstance(summary, dict) else None
    return record if isinstance(record.get("event"), str) else None


class _Progress(BaseModel):
    """An event a progress bar follows; the event's other fields are the log's, not the bar's."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class TrainTick(_Progress):
    """`train`: training logged a point of its curve."""

    step: int
    steps: int
    loss: float
    samples_per_s: float = 0.0
    eta_s: float | None = None


class Resumed(_Progress):
    """`resume`: training resumed from a checkpoint at `step`."""

    step: int


class Late(_Progress):
    """`late`: training is forecast to end past its deadline."""

    deadline_minutes: float | None = None
    forecast_minutes: float | None = None


class ShardDone(_Progress):
    """`infer_shard`: a rank finished one shard of batch inference."""

    shards: int
    rows_per_s: float = 0.0
    rank: int = 0


PROGRESS: dict[str, type[_Progress]] = {"train": TrainTick, "resume": Resumed, "late": Late,
                                        "infer_shard": ShardDone}


def progress_of(event: dict[str, Any]) -> _Progress | None:
    """The progress an event reports, typed; None for any other event, or one that lacks a field a
    bar needs (a rank's line cut short)."""
    kind = PROGRESS.get(str(event.get("event")))
    if kind is None:
        return None
    try:
        return kind.model_validate(event)
    except ValidationError:
        return None


def duration(seconds: float) -> str:
    """A time in the unit a person reads it in: `42 s`, `3.5 min`, `2.1 h`."""
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    text = value if isinstance(value, str) else json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= _LONG else text[: _LONG - 1] + "…"


def _fields(record: dict[str, Any], skip: tuple[str, ...] = ()) -> list[str]:
    return [f"{key.replace('_', ' ')} {_value(value)}" for key, value in record.items()
            if key not in _NOT_SHOWN and key not in skip]


def readable(record: dict[str, Any]) -> str:
    """One event as a log line: its name, then its fields in words (training points and shards of
    inference in the form their progress is usually read). A `train` event's loss is rank 0's mean
    over the steps since the event before it (`train.log_every` of them, as its samples/s is), not
    its step's alone, and its line says so: `step 200/200, mean loss 0.3760`; with the time its steps
    left would take at that rate (`3.5 min left`)."""
    event = record["event"]
    head = event if not record.get("rank") else f"{event} (rank {record['rank']})"
    if event == "train" and {"step", "steps", "loss", "samples_per_s"} <= set(record):
        rest = _fields(record, skip=("step", "steps", "loss", "samples_per_s", "eta_s"))
        left = f", {duration(record['eta_s'])} left" if isinstance(record.get("eta_s"), int | float) else ""
        return (f"{head}: step {record['step']}/{record['steps']}, mean loss {record['loss']:.4f}, "
                f"{record['samples_per_s']:,.0f} samples/s{left}" + "".join(f", {f}" for f in rest))
    if event == "infer_shard" and {"shard", "shards"} <= set(record):
        rest = _fields(record, skip=("shard", "shards"))
        return f"{head}: shard {record['shard'] + 1}/{record['shards']}" + "".join(f", {f}" for f in rest)
    fields = _fields(record)
    return f"{head}: {', '.join(fields)}" if fields else head
