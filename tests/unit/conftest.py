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


@pytest.fixture(scope="session")
def prompts(reviews) -> pa.Table:
    """The reviews with each one's prompt and completion, as `trnflow data synth --format
    prompt-completion` writes them."""
    from trnflow.workload.synth import prompt_completion

    pairs = [prompt_completion(row) for row in reviews.to_pylist()]
    return reviews.append_column("prompt", pa.array([p["prompt"] for p in pairs])).append_column(
        "completion", pa.array([p["completion"] for p in pairs]))


@pytest.fixture(scope="session")
def decoder_folder(tmp_path_factory, prompts):
    """A tiny pretrained Llama-style decoder and its own tokenizer, learned from the prompts."""
    from tests.pretrained import tiny_causal_lm

    texts = prompts.column("prompt").to_pylist() + prompts.column("completion").to_pylist()
    return tiny_causal_lm(tmp_path_factory.mktemp("pretrained") / "decoder", texts)
