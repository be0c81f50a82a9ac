"""Fixtures the unit tests share."""

from __future__ import annotations

import pyarrow as pa
import pytest

from trnflow.workload.synth import synthesize


@pytest.fixture(scope="session")
def reviews(tmp_path_factory) -> pa.Table:
    """Sixty synthetic reviews with their labels: a recipe's training rows."""
    import pyarrow.json as pajson

    root = tmp_path_factory.mktemp("reviews")
    synthesize(root, days=1, rows_per_day=60, seed=3, fmt="jsonl")
    return pa.concat_tables([pajson.read_json(f) for f in sorted((root / "train").rglob("*.jsonl"))])
