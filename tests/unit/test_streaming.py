"""Reading data a batch at a time: every format gives the rows a whole read gives, errors name the
row in its file, the tokenizer learns from a stream, and featurized rows spilled to local disk read
back exactly as in memory."""

import hashlib
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.conftest import tiny_m5
from trnflow.errors import DataError
from trnflow.specs import DataSpec
from trnflow.storage.datafiles import data_files
from trnflow.workload import data as data_module
from trnflow.workload.data import iter_labelled, iter_unlabelled, read_labelled
from trnflow.workload.features import FeatureRows, featurize
from trnflow.workload.synth import synthesize

TEXT = ["text"]


def _spec(root, fmt="jsonl") -> DataSpec:
    return DataSpec(train=str(root / "train"), holdout=str(root / "holdout"), inference=str(root / "inference"),
                    format=fmt)


@pytest.fixture
def small_batches(monkeypatch):
    """Batches of 64 rows, and 4 KiB of text parsed at a time: files of a few hundred rows stream."""
    monkeypatch.setattr(data_module, "BATCH_ROWS", 64)
    monkeypatch.setattr(data_module, "BLOCK_BYTES", 4096)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "csv", "amazon-polarity"])
def test_every_format_streams_in_bounded_batches_the_rows_a_whole_read_gives(tmp_path, fmt, small_batches):
    synthesize(tmp_path, days=2, rows_per_day=500, seed=4, fmt=fmt)
    if fmt == "parquet":  # small row groups too, so a Parquet file is read a row group at a time
        for path in (tmp_path / "train").rglob("*.parquet"):
            pq.write_table(pq.read_table(path), path, row_group_size=100)
    spec = _spec(tmp_path, fmt)
    files = data_files(spec.train, fmt)
    batches = list(iter_labelled(files, spec, TEXT, 2, spec.train))
    assert len(batches) > 2 * 500 // 64 and max(b.num_rows for b in batches) <= 64
    whole = read_labelled(files, spec, TEXT, 2, spec.train)
    assert len(whole.labels) == 1000
    streamed = pa.concat_tables(batches)
    assert streamed.column("text").to_pylist() == whole.table.column("text").to_pylist()
    assert streamed.column("label").to_pylist() == whole.labels.tolist()
    if fmt == "amazon-polarity":  # ids count rows across batches: <file>:<row in the file>
        ids = pa.concat_tables(iter_unlabelled(spec.inference, spec, TEXT)).column("id").to_pylist()
        assert ids == [f"part-00000.csv:{i}" for i in range(500)]


def test_a_bad_label_deep_in_a_file_is_named_by_its_row_in_the_file(tmp_path, small_batches):
    rows = [{"id": f"r{i}", "text": f"row {i}", "label": 7 if i == 250 else i % 2} for i in range(300)]
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = _spec(tmp_path)
    with pytest.raises(DataError, match=r"part\.jsonl: label 7 in row 250 is outside 0\.\.1"):
        list(iter_labelled(data_files(spec.train, "jsonl"), spec, TEXT, 2, spec.train))


def test_an_empty_day_stops_the_stream_once_every_day_was_read(tmp_path, small_batches):
    synthesize(tmp_path, days=2, rows_per_day=100, seed=1)
    (tmp_path / "train" / "dt=2026-01-01" / "part-00000.jsonl").write_text("")
    spec = _spec(tmp_path)
    with pytest.raises(DataError, match="dt=2026-01-01"):
        list(iter_labelled(data_files(spec.train, "jsonl"), spec, TEXT, 2, spec.train))


def test_the_tokenizer_learned_from_a_stream_is_the_one_learned_from_the_whole_table(tmp_path, small_batches):
    synthesize(tmp_path, days=2, rows_per_day=400, seed=2)
    spec = _spec(tmp_path)
    files = data_files(spec.train, "jsonl")
    whole, streamed = tiny_m5(), tiny_m5()
    whole.fit(read_labelled(files, spec, TEXT, 2, spec.train).table)
    streamed.fit_batches(t.select(TEXT) for t in iter_labelled(files, spec, TEXT, 2, spec.train))
    assert streamed.state() == whole.state()


@pytest.mark.parametrize("limit", [0, None], ids=["spilled", "in-memory"])
def test_featurized_rows_read_back_exactly_whether_spilled_to_disk_or_in_memory(limit):
    features = torch.randint(0, 30_000, (1000, 8), generator=torch.Generator().manual_seed(0))
    rows = FeatureRows(limit_bytes=limit)
    for part in features.split(96):
        rows.append(part)
    rows.finish()
    assert rows.spilled == (limit == 0) and len(rows) == 1000
    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(1))[:77]
    assert torch.equal(rows[shuffled], features[shuffled])  # a training batch: rows anywhere, in its order
    assert torch.equal(rows[torch.arange(200, 450)], features[200:450])  # an inference shard: one run
    assert rows[torch.arange(0)].shape == (0, 8)
    with pytest.raises(IndexError):
        rows[torch.tensor([3, 1000])]
    with pytest.raises(ValueError, match="every row must have one shape"):
        rows.append(torch.zeros(2, 9, dtype=features.dtype))


def test_the_inference_digest_is_the_one_the_plan_always_had(tmp_path, small_batches):
    """A shard committed before rows were streamed is still recognised by its plan."""
    synthesize(tmp_path, days=1, rows_per_day=10, seed=5, inference_rows=300)
    spec = _spec(tmp_path)
    recipe = tiny_m5()
    recipe.fit(read_labelled(data_files(spec.train, "jsonl"), spec, TEXT, 2, spec.train).table)
    got = featurize(iter_unlabelled(spec.inference, spec, TEXT), recipe, id_field="id", digest=True)
    table = pa.concat_tables(iter_unlabelled(spec.inference, spec, TEXT))
    want = hashlib.sha256()
    for row_id, text in zip(table.column("id").to_pylist(), table.column("text").to_pylist(), strict=True):
        want.update(f"{row_id}\t{text}\n".encode())
    assert got.digest == want.hexdigest()
    assert got.ids.to_pylist() == table.column("id").to_pylist()
    assert torch.equal(got.features[torch.arange(300)], recipe.features(table.select(TEXT)))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_a_column_empty_in_the_first_pieces_and_text_later_reads_as_a_whole_read_does(tmp_path, fmt, small_batches):
    """Column types are inferred a piece at a time, so text after 2,000 empty rows is still text,
    and a count after 2,000 whole numbers may have a fraction."""
    rows = [{"id": f"r{i}", "text": None if i < 2000 else f"late {i}", "label": i % 2, "x": 1 if i < 2000 else 1.5}
            for i in range(2010)]
    folder = tmp_path / "train"
    folder.mkdir()
    if fmt == "jsonl":
        (folder / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        (folder / "part.csv").write_text("id,text,label,x\n" + "".join(
            f"{r['id']},{r['text'] or ''},{r['label']},{r['x']}\n" for r in rows))
    spec = _spec(tmp_path, fmt)
    table = read_labelled(data_files(spec.train, fmt), spec, ["text", "x"], 2, spec.train).table
    assert table.column("text").to_pylist()[-1] == "late 2009" and table.column("x").to_pylist()[-1] == 1.5


def test_a_quoted_line_break_in_a_csv_field_never_splits_its_record(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "BLOCK_BYTES", 64)  # pieces far shorter than a record
    texts = [f'line one of {i}\nline "two" of {i}, with a comma' for i in range(50)]
    folder = tmp_path / "train"
    folder.mkdir()
    (folder / "part.csv").write_text("id,text,label\n" + "".join(
        f'r{i},"{t.replace(chr(34), chr(34) * 2)}",{i % 2}\n' for i, t in enumerate(texts)))
    spec = _spec(tmp_path, "csv")
    rows = read_labelled(data_files(spec.train, "csv"), spec, TEXT, 2, spec.train)
    assert rows.table.column("text").to_pylist() == texts and rows.labels.tolist() == [i % 2 for i in range(50)]
