"""TensorBoard event files as trnflow writes them, read back by TensorBoard's own reader."""

from __future__ import annotations

import struct

import pytest

from tests.conftest import quickstart_data
from trnflow.reporting.tensorboard import crc32c, event_file
from trnflow.reporting.tracking import TrackedMetric


def _scalars(folder) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(folder))
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def test_crc32c_is_castagnolis():
    assert crc32c(b"123456789") == 0xE3069283  # the check value of CRC-32C
    assert crc32c(b"") == 0


def test_tensorboard_reads_every_metric_at_its_step(tmp_path):
    metrics = [TrackedMetric(key="train/loss", value=2.0 - step / 100, step=step) for step in (5, 10, 3_000_000_000)]
    metrics += [TrackedMetric(key="eval/accuracy", value=0.75, step=10), TrackedMetric(key="cost/total_usd", value=0.0,
                                                                                      step=0)]
    (tmp_path / "events.out.tfevents.run-1.trnflow").write_bytes(event_file(metrics, wall_time=1.7e9))
    read = _scalars(tmp_path)
    assert read == {"train/loss": [(5, pytest.approx(1.95)), (10, pytest.approx(1.9)),
                                   (3_000_000_000, pytest.approx(2.0 - 3e7))],
                    "eval/accuracy": [(10, 0.75)], "cost/total_usd": [(0, 0.0)]}


def test_a_torn_event_file_is_seen_as_torn_by_tensorboard(tmp_path):
    """The framing's checksums are TensorBoard's: a flipped byte in an event is not read as a value."""
    data = bytearray(event_file([TrackedMetric(key="train/loss", value=1.0, step=1)], wall_time=1.7e9))
    first = struct.unpack("<Q", data[:8])[0]
    data[8 + 4 + first + 4 + 12 + 10] ^= 0xFF  # inside the second event
    (tmp_path / "events.out.tfevents.torn").write_bytes(bytes(data))
    assert _scalars(tmp_path).get("train/loss", []) == []


def test_a_runs_event_file_on_s3_is_read_by_tensorboard_from_s3(in_process_aws):
    """`tensorboard --logdir s3://...` reads a run's file where trnflow put it: TensorBoard's own S3
    reader (boto3) on moto."""
    from trnflow import aws
    from trnflow.reporting.tensorboard import folder, logdir, write_events
    from trnflow.results import RunOutcome, TrainResult
    from trnflow.specs import validate_spec

    aws.client("s3").create_bucket(Bucket="runs")
    spec = validate_spec(quickstart_data(train={"checkpoint_url": "s3://runs/checkpoints", "lr": 0.01}))
    curve = [{"step": 5, "global_step": 5, "loss": 0.7, "samples_per_s": 900.0},
             {"step": 10, "global_step": 10, "loss": 0.6, "samples_per_s": 950.0}]
    outcome = RunOutcome(run_id="r-1", results={"train": TrainResult(checkpoint=None, curve=curve)})
    note = write_events(spec, outcome)
    assert folder(spec, "r-1") == "s3://runs/checkpoints/r-1/tensorboard" and logdir(spec.train.checkpoint_url) in note
    read = _scalars("s3://runs/checkpoints/r-1/tensorboard")
    assert read["train/loss"] == [(5, pytest.approx(0.7)), (10, pytest.approx(0.6))]
    assert read["train/lr"] == [(5, pytest.approx(0.01)), (10, pytest.approx(0.01))]
