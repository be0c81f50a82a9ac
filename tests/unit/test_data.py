"""Data: every format from file:// and s3://, day partitions and the watermark window, the
tokenizer, and the sampler's saved position."""

import subprocess
import sys

import boto3
import pytest
import torch

from trnflow.errors import DataError, FatalError
from trnflow.specs import DataSpec
from trnflow.storage.datafiles import data_files, new_partitions, partitions, since_watermark
from trnflow.workload.data import StepSampler, read_labelled, read_unlabelled
from trnflow.workload.recipes.m5_text.tokenizer import TextTokenizer, train_tokenizer
from trnflow.workload.synth import synthesize

TEXT = ["text"]
"""The column the built-in recipe reads."""


def _spec(root, fmt="jsonl") -> DataSpec:
    return DataSpec(train=str(root / "train"), holdout=str(root / "holdout"), inference=str(root / "inference"),
                    format=fmt)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "amazon-polarity"])
def test_every_format_reads_the_same_rows(tmp_path, fmt):
    synthesize(tmp_path / "j", days=2, rows_per_day=30, seed=1, fmt="jsonl")
    synthesize(tmp_path / fmt, days=2, rows_per_day=30, seed=1, fmt=fmt)
    want = read_labelled(data_files(str(tmp_path / "j" / "train"), "jsonl"), _spec(tmp_path / "j"), TEXT, 2, "j")
    spec = _spec(tmp_path / fmt, fmt)
    got = read_labelled(data_files(spec.train, fmt), spec, TEXT, 2, spec.train)
    assert torch.equal(got.labels, want.labels)
    squash = [" ".join(t.replace(". ", " ").split()) for t in got.lines()]
    assert squash == want.lines()
    ids = read_unlabelled(spec.inference, spec, TEXT).ids
    assert len(ids) == 30 and len(set(ids)) == 30


def test_amazon_polarity_labels_map_to_zero_and_one_and_others_are_refused(tmp_path):
    (tmp_path / "ok.csv").write_text('"2","Great","works well"\n"1","Bad","broke, sadly"\n')
    spec = DataSpec(train=str(tmp_path / "ok.csv"), holdout=".", inference=".", format="amazon-polarity")
    rows = read_labelled(data_files(spec.train, spec.format), spec, TEXT, 2, spec.train)
    assert rows.labels.tolist() == [1, 0] and rows.lines() == ["Great. works well", "Bad. broke, sadly"]
    (tmp_path / "bad.csv").write_text('"3","Meh","so so"\n')
    with pytest.raises(DataError, match="label 1 or 2"):
        read_labelled(data_files(str(tmp_path / "bad.csv"), spec.format), spec, TEXT, 2, "bad")


def test_partitions_sort_by_day_and_the_window_starts_after_the_watermark(tmp_path):
    synthesize(tmp_path, days=3, rows_per_day=10, seed=1, fmt="parquet")
    files = data_files(str(tmp_path / "train"), "parquet")
    assert partitions(files) == ["2026-01-01", "2026-01-02", "2026-01-03"]
    assert partitions(since_watermark(files, "2026-01-01", "train")) == ["2026-01-02", "2026-01-03"]
    assert since_watermark(files, "2026-01-03", "train") == []
    assert len(since_watermark(files, None, "train")) == 3
    (tmp_path / "train" / "loose.parquet").write_bytes((tmp_path / "holdout" / "part-00000.parquet").read_bytes())
    with pytest.raises(DataError, match=r"loose\.parquet is not"):
        since_watermark(data_files(str(tmp_path / "train"), "parquet"), None, "train")


def test_with_a_ready_marker_only_the_days_marked_complete_count(tmp_path):
    synthesize(tmp_path, days=3, rows_per_day=10, seed=1)
    train = str(tmp_path / "train")
    for day in ("2026-01-01", "2026-01-02"):
        (tmp_path / "train" / f"dt={day}" / "_SUCCESS").write_text("")
    assert partitions(data_files(train, "jsonl", "_SUCCESS")) == ["2026-01-01", "2026-01-02"]
    assert new_partitions(train, "jsonl", "2026-01-01", "_SUCCESS") == ["2026-01-02"]
    assert new_partitions(train, "jsonl", "2026-01-02", "_SUCCESS") == []  # 01-03 is still being written
    assert new_partitions(train, "jsonl", "2026-01-02") == ["2026-01-03"]  # without a marker, every day counts
    nested = tmp_path / "train" / "dt=2026-01-02" / "region=eu"
    nested.mkdir()
    (nested / "part-00001.jsonl").write_bytes((tmp_path / "train" / "dt=2026-01-02" / "part-00000.jsonl").read_bytes())
    assert [f.name for f in data_files(train, "jsonl", "_SUCCESS")] == [
        "dt=2026-01-01/part-00000.jsonl", "dt=2026-01-02/part-00000.jsonl", "dt=2026-01-02/region=eu/part-00001.jsonl"]


def test_partitioned_parquet_is_read_from_s3(tmp_path, s3_bucket):
    synthesize(tmp_path, days=2, rows_per_day=25, seed=4, fmt="parquet")
    s3 = boto3.client("s3")
    for path in (tmp_path / "train").rglob("*.parquet"):
        s3.upload_file(str(path), s3_bucket, f"reviews/{path.relative_to(tmp_path).as_posix()}")
    url = f"s3://{s3_bucket}/reviews/train"
    files = data_files(url, "parquet")
    assert partitions(files) == ["2026-01-01", "2026-01-02"]
    assert files[0].url == f"{url}/dt=2026-01-01/part-00000.parquet"
    spec = DataSpec(train=url, holdout=url, inference=url, format="parquet")
    local = _spec(tmp_path, "parquet")
    assert read_labelled(files, spec, TEXT, 2, url).lines() == read_labelled(
        data_files(local.train, "parquet"), local, TEXT, 2, local.train).lines()
    with pytest.raises(DataError, match="no such folder"):
        data_files(f"s3://{s3_bucket}/nothing-here", "parquet")


@pytest.mark.parametrize(("content", "message"), [
    ('{"text": "ok", "label": 5}\n', "label 5 in row 0 is outside 0..1"),
    ('{"body": "ok", "label": 1}\n', "missing column"),
    ('{"text": "ok", "label": 1\n', "cannot be read as jsonl"),
    ('{"text": "ok", "label": "positive"}\n', "must hold integer class ids"),
    ('{"text": "ok", "label": 0.5}\n', "holds double values"),
])
def test_bad_rows_are_named_with_the_fix(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content)
    spec = DataSpec(train=str(tmp_path / "d.jsonl"), holdout=".", inference=".")
    with pytest.raises(DataError, match=message):
        read_labelled(data_files(spec.train, "jsonl"), spec, TEXT, 2, spec.train)


def test_a_missing_dataset_says_where_it_looked(tmp_path):
    with pytest.raises(DataError, match="no such"):
        data_files(str(tmp_path / "absent"), "jsonl")
    with pytest.raises(DataError, match="no such file"):
        data_files(str(tmp_path / "absent.jsonl"), "jsonl")


TEXTS = ["the kettle is very sturdy", "broken lid and slow motor", "my lamp arrived late", "great strap"] * 50


def test_the_tokenizer_is_fixed_shape_and_the_same_in_every_process():
    tok = train_tokenizer(TEXTS, 512, 8)
    out = tok.encode(["the kettle is very sturdy", "", "great strap " * 20])
    assert out.shape == (3, 8)
    assert out[1].tolist() == [1] + [0] * 7  # an empty text still has its [CLS]
    assert out[0, 0] == 1 and (out[2] != 0).all()  # long text cut to seq_len
    script = ("from trnflow.workload.recipes.m5_text.tokenizer import train_tokenizer; "
              f"print(train_tokenizer({TEXTS!r}, 512, 8).to_json())")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert other.strip() == tok.to_json()
    again = TextTokenizer.from_json(tok.to_json(), 8, 512, "saved")
    assert torch.equal(again.encode(TEXTS[:4]), tok.encode(TEXTS[:4]))


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused():
    tok = train_tokenizer(TEXTS, 512, 8)
    with pytest.raises(FatalError, match=r"raise model\.params\.vocab_size"):
        TextTokenizer.from_json(tok.to_json(), 8, 10, "file:///ckpt/tokenizer.json")


def test_the_sampler_position_round_trips_and_refuses_other_data():
    sampler = StepSampler(1000, 32, rank=0, world=2, seed=5)
    position = sampler.position(45)
    assert position == {"step": 45, "epoch": 1, "batch_in_epoch": 14, "rows": 1000, "global_batch": 32, "seed": 5}
    assert StepSampler(1000, 32, rank=1, world=4, seed=5).restore(position) == 45
    with pytest.raises(DataError, match="rows=1000"):
        StepSampler(1200, 32, rank=0, world=2, seed=5).restore(position)


def test_the_reference_run_is_a_new_one_when_a_partition_arrives(make_spec, tmp_path):
    import shutil

    from trnflow.backends.reference import _data_digest

    data = tmp_path / "data"
    synthesize(data, days=2, rows_per_day=20, seed=1)
    spec = make_spec(data={"train": str(data / "train")})
    before = _data_digest(spec)
    assert _data_digest(spec) == before  # the same data resumes the same reference run
    shutil.copytree(data / "train" / "dt=2026-01-02", data / "train" / "dt=2026-01-03")
    assert _data_digest(spec) != before
