"""TensorBoard event files of a run's step metrics (`tracking.tensorboard`), written by the
orchestrator when the run ends, under `<train.checkpoint_url>/<run id>/tensorboard/`, so that
`tensorboard --logdir <train.checkpoint_url>` shows every run beside the others.

The file format is TensorFlow's record framing around `Event` protocol buffers; trnflow writes
the few fields a scalar needs itself (TensorBoard is a viewer, not a dependency):

    record  = length (uint64 LE) · masked crc32c of length (uint32 LE) · event · masked crc32c of event
    Event   = 1 wall_time (double) · 2 step (int64) · 3 file_version (string) · 5 summary
    Summary = 1 value (repeated): 1 tag (string) · 2 simple_value (float)
"""

from __future__ import annotations

import struct
import time
from collections import defaultdict
from collections.abc import Iterable

from trnflow.redact import without_credentials
from trnflow.reporting.tracking import TrackedMetric, step_metrics
from trnflow.results import RunOutcome
from trnflow.specs import JobSpec
from trnflow.storage import local_path, open_store

FILE_VERSION = "brain.Event:2"
_MASK_DELTA = 0xA282EAD8


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF)


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= (1 << 64) - 1  # int64 as protobuf writes it: a negative step is ten bytes
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (a string or a message)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int = 0, values: Iterable[tuple[str, float]] = (),
           file_version: str | None = None) -> bytes:
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step:
        out += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    summary = b"".join(_field(1, _field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
                       for tag, value in values)
    if summary:
        out += _field(5, summary)
    return out


def _record(event: bytes) -> bytes:
    length = struct.pack("<Q", len(event))
    return length + _masked_crc(length) + event + _masked_crc(event)


def event_file(metrics: Iterable[TrackedMetric], wall_time: float) -> bytes:
    """An event file holding `metrics`: one event per step, its scalars by tag."""
    by_step: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for metric in metrics:
        by_step[metric.step].append((metric.key, metric.value))
    events = [_event(wall_time, file_version=FILE_VERSION)]
    events += [_event(wall_time, step, by_step[step]) for step in sorted(by_step)]
    return b"".join(_record(e) for e in events)


def folder(spec: JobSpec, run_id: str) -> str:
    """Where a run's event files go."""
    return f"{spec.train.checkpoint_url.rstrip('/')}/{run_id}/tensorboard"


def write_events(spec: JobSpec, outcome: RunOutcome) -> str:
    """Write the run's step metrics (the ones MLflow gets) as one event file, replacing the one an
    earlier attempt of the same run wrote: a line for the run's summary. Raises what the store
    raises."""
    assert outcome.run_id is not None
    metrics = step_metrics(spec, outcome)
    where = folder(spec, outcome.run_id)
    name = f"events.out.tfevents.{outcome.run_id}.trnflow"
    open_store(where).write(name, event_file(metrics, time.time()))
    return (f"tensorboard: {len(metrics)} points in {without_credentials(where)}/{name}; "
            f"`tensorboard --logdir {logdir(spec.train.checkpoint_url)}` shows them")


def logdir(checkpoint_url: str) -> str:
    """What to give `tensorboard --logdir`: a local folder as a path (TensorBoard reads no file://
    URLs), an s3:// one as it is."""
    if checkpoint_url.startswith("s3://"):
        return without_credentials(checkpoint_url)
    return str(local_path(checkpoint_url))
