"""Data: every format from file:// and s3://, day partitions and the watermark window, the
tokenizer, and the sampler's saved position."""

import json
import subprocess
import sys

import boto3
import pytest
import torch
import yaml

from tests.conftest import quickstart_data
from trnflow.errors import DataError, FatalError
from trnflow.specs import DataSpec
from trnflow.storage.datafiles import data_files, new_partitions, partitions, since_watermark
from trnflow.workload.data import read_labelled, read_unlabelled
from trnflow.workload.recipes.m5_text.tokenizer import TextTokenizer, train_tokenizer
from trnflow.workload.sampler import StepSampler
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


@pytest.mark.slow  # a second Python process importing torch: with the integration tests
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

    from trnflow.lifecycle.references import reference_key

    data = tmp_path / "data"
    synthesize(data, days=2, rows_per_day=20, seed=1)
    spec = make_spec(data={"train": str(data / "train")})
    before = reference_key(spec)
    assert reference_key(spec) == before  # the same data resumes the same reference run
    shutil.copytree(data / "train" / "dt=2026-01-02", data / "train" / "dt=2026-01-03")
    assert reference_key(spec) != before


# -- a day that cannot be read is an error, and the watermark never passes a day that was not read ----


def _parquet_days(root, days=3):
    synthesize(root, days=days, rows_per_day=10, seed=2, fmt="parquet")
    return root / "train"


def test_a_day_written_in_another_format_is_listed_and_refused_naming_it(tmp_path):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from trnflow.storage.datafiles import training_window

    train = _parquet_days(tmp_path)
    day = train / "dt=2026-01-02"
    pacsv.write_csv(pq.read_table(day / "part-00000.parquet"), day / "part-00000.csv")
    (day / "part-00000.parquet").unlink()
    url = str(train)
    # the retraining flow sees the day, so a run is started for it rather than the day passed over
    assert new_partitions(url, "parquet", "2026-01-01") == ["2026-01-02", "2026-01-03"]
    listing = data_files(url, "parquet", every=True)
    for window in ("since-watermark", "all"):
        with pytest.raises(DataError, match=r"day dt=2026-01-02 \(dt=2026-01-02/part-00000\.csv\) holds no parquet "
                                            r"files \(data\.format\), only \.csv files; write the day as parquet"):
            training_window(listing, window, None, url, "parquet")
    # a day already behind the watermark is not read again, so it stops nothing
    assert partitions(training_window(listing, "since-watermark", "2026-01-02", url, "parquet").files) == [
        "2026-01-03"]
    # a day holding a file of another format beside its own is refused too: those rows would never be read
    pacsv.write_csv(pq.read_table(train / "dt=2026-01-03" / "part-00000.parquet"), train / "dt=2026-01-03" / "x.csv")
    with pytest.raises(DataError, match=r"dt=2026-01-03 .*holds dt=2026-01-03/x\.csv, which is not parquet"):
        training_window(data_files(url, "parquet", every=True), "since-watermark", "2026-01-02", url, "parquet")


def test_a_day_without_the_recipes_columns_or_rows_fails_naming_the_day(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = _parquet_days(tmp_path)
    spec = _spec(tmp_path, "parquet")
    part = train / "dt=2026-01-02" / "part-00000.parquet"
    rows = pq.read_table(part)
    pq.write_table(rows.rename_columns(["body" if c == "text" else c for c in rows.column_names]), part)
    with pytest.raises(DataError, match=r"day dt=2026-01-02 \(dt=2026-01-02/part-00000\.parquet\) cannot be read: "
                                        r".*missing column\(s\) \['text'\]"):
        read_labelled(data_files(spec.train, "parquet"), spec, TEXT, 2, spec.train)
    pq.write_table(rows.slice(0, 0), part)  # the day's file is there, with the columns, but no rows
    with pytest.raises(DataError, match=r"day dt=2026-01-02 \(dt=2026-01-02/part-00000\.parquet\) has no rows"):
        read_labelled(data_files(spec.train, "parquet"), spec, TEXT, 2, spec.train)
    pq.write_table(rows.slice(0, 0).append_column("extra", pa.array([], pa.int64())), part)
    files = [f for f in data_files(spec.train, "parquet") if f.partition != "2026-01-02"]
    assert len(read_labelled(files, spec, TEXT, 2, spec.train).ids) == 20  # the other days read as before


def test_the_watermark_never_passes_a_day_that_is_not_ready(tmp_path):
    from trnflow.storage.datafiles import training_window

    synthesize(tmp_path, days=4, rows_per_day=10, seed=1)
    url = str(tmp_path / "train")
    for day in ("2026-01-01", "2026-01-03", "2026-01-04"):  # 01-02 is still being written
        (tmp_path / "train" / f"dt={day}" / "_SUCCESS").write_text("")
    assert new_partitions(url, "jsonl", None, "_SUCCESS") == ["2026-01-01"]
    assert new_partitions(url, "jsonl", "2026-01-01", "_SUCCESS") == []  # 01-03 and 01-04 wait for 01-02
    listing = data_files(url, "jsonl", "_SUCCESS", every=True)
    incremental = training_window(listing, "since-watermark", None, url, "jsonl")
    assert (partitions(incremental.files), incremental.watermark) == (["2026-01-01"], "2026-01-01")
    everything = training_window(listing, "all", None, url, "jsonl")  # reads every ready day ...
    assert partitions(everything.files) == ["2026-01-01", "2026-01-03", "2026-01-04"]
    assert everything.watermark == "2026-01-01"  # ... but records no watermark past the day it left
    (tmp_path / "train" / "dt=2026-01-02" / "_SUCCESS").write_text("")
    assert new_partitions(url, "jsonl", "2026-01-01", "_SUCCESS") == ["2026-01-02", "2026-01-03", "2026-01-04"]


def test_a_day_marked_ready_with_no_files_is_refused(tmp_path):
    from trnflow.storage.datafiles import training_window

    synthesize(tmp_path, days=2, rows_per_day=10, seed=1)
    empty = tmp_path / "train" / "dt=2026-01-03"
    empty.mkdir()
    for day in ("2026-01-01", "2026-01-02", "2026-01-03"):
        (tmp_path / "train" / f"dt={day}" / "_SUCCESS").write_text("")
    url = str(tmp_path / "train")
    assert new_partitions(url, "jsonl", "2026-01-02", "_SUCCESS") == ["2026-01-03"]
    with pytest.raises(DataError, match=r"dt=2026-01-03 \(dt=2026-01-03/_SUCCESS\) is marked ready by _SUCCESS but "
                                        r"holds no jsonl files"):
        training_window(data_files(url, "jsonl", "_SUCCESS", every=True), "since-watermark", "2026-01-02", url,
                        "jsonl")
    # files of another format outside the day folders are left alone, as before
    (tmp_path / "train" / "README.md").write_text("reviews, by day\n")
    assert [f.name for f in data_files(url, "jsonl")] == ["dt=2026-01-01/part-00000.jsonl",
                                                          "dt=2026-01-02/part-00000.jsonl"]


def test_data_check_counts_each_days_rows_read_and_rejected(tmp_path):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from trnflow.workload.datacheck import check_data

    train = _parquet_days(tmp_path)
    day = train / "dt=2026-01-02"
    pacsv.write_csv(pq.read_table(day / "part-00000.parquet"), day / "part-00000.csv")
    (day / "part-00000.parquet").unlink()
    parts = {(p.field, p.day): p for p in check_data(_spec(tmp_path, "parquet"), TEXT, 2)}
    assert sorted(parts) == [("data.holdout", None), ("data.inference", None), ("data.train", "2026-01-01"),
                             ("data.train", "2026-01-02"), ("data.train", "2026-01-03")]
    bad = parts["data.train", "2026-01-02"]
    assert (bad.state, bad.rows_read, bad.rows_rejected) == ("failed", 0, 10)
    assert bad.problems == ["dt=2026-01-02/part-00000.csv: not parquet (data.format), so no run reads it",
                            "no readable rows in parquet"]
    good = parts["data.train", "2026-01-03"]
    assert (good.state, good.rows_read, good.rows_rejected, good.problems) == ("ok", 10, 0, [])
    assert parts["data.inference", None].rows_read == 10 and parts["data.holdout", None].state == "ok"


TORCH_PROBE = """
import json, sys
{run}
print(json.dumps({{"result": result, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}}))
"""


def _probe(run: str) -> dict:
    """`run` (which sets `result`) in a fresh interpreter, and the torch modules loaded by then."""
    out = subprocess.run([sys.executable, "-c", TORCH_PROBE.format(run=run)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_data_check_reads_every_set_without_loading_torch(tmp_path):
    """`trnflow data check`'s reading (`datacheck`, and the readers under it) loads no torch: the sampler,
    which needs it, is a module of its own."""
    synthesize(tmp_path, days=2, rows_per_day=10, seed=1)
    run = (f"from trnflow.specs import DataSpec\n"
           f"from trnflow.workload.datacheck import check_data\n"
           f"spec = DataSpec(train={str(tmp_path / 'train')!r}, holdout={str(tmp_path / 'holdout')!r}, "
           f"inference={str(tmp_path / 'inference')!r})\n"
           f"result = [(p.field, p.day, p.state, p.rows_read) for p in check_data(spec, ['text'], 2)]")
    found = _probe(run)
    assert found["result"] == [["data.train", "2026-01-01", "ok", 10], ["data.train", "2026-01-02", "ok", 10],
                               ["data.holdout", None, "ok", 10], ["data.inference", None, "ok", 10]]
    assert found["torch"] == []


def test_the_data_check_command_loads_no_torch(tmp_path):
    """The whole command, as a person runs it, in a fresh interpreter: its report, and no torch."""
    synthesize(tmp_path / "data", days=2, rows_per_day=10, seed=1)
    urls = {name: str(tmp_path / "data" / name) for name in ("train", "holdout", "inference")}
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(quickstart_data(data={**urls, "format": "jsonl"})))
    run = ("import contextlib, io\n"
           "from trnflow.cli import main\n"
           f"sys.argv = ['trnflow', 'data', 'check', {str(spec)!r}, '--json']\n"
           "out = io.StringIO()\n"
           "with contextlib.redirect_stdout(out):\n"
           "    try:\n"
           "        main.main()\n"
           "    except SystemExit as exc:\n"
           "        code = exc.code\n"
           "result = [code, json.loads(out.getvalue())['ok']]")
    found = _probe(run)
    assert found["result"] == [0, True]
    assert found["torch"] == []


def test_data_check_shows_a_day_not_ready_as_waiting_and_the_days_it_holds_back(tmp_path):
    from trnflow.workload.datacheck import check_set

    synthesize(tmp_path, days=3, rows_per_day=10, seed=1)
    for day in ("2026-01-01", "2026-01-03"):
        (tmp_path / "train" / f"dt={day}" / "_SUCCESS").write_text("")
    spec = DataSpec(train=str(tmp_path / "train"), holdout=".", inference=".", ready_marker="_SUCCESS")
    parts = check_set("data.train", spec.train, spec, TEXT, 2, spec.ready_marker)
    assert [(p.day, p.state, p.rows_read) for p in parts] == [("2026-01-01", "ok", 10), ("2026-01-02", "waiting", 0),
                                                              ("2026-01-03", "ok", 10)]
    assert parts[2].notes == ["read once dt=2026-01-02 is ready"]
