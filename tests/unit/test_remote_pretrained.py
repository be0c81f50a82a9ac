"""A pretrained folder on S3 (`model.params.pretrained: s3://...`): each job fetches it into a cache
folder of its machine by the digest of its EXPORTED marker, every file checked; a copy already there
is checked again before use; a file that does not match its marker stops the job; planning reads
its config alone; `trnflow validate --data-check` reads its marker."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import boto3
import pytest
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from tests.pretrained import tiny_causal_lm
from trnflow.cli.app import app
from trnflow.errors import FatalError
from trnflow.records import EXPORT_MARKER, ExportedFile, ExportMarker, dump
from trnflow.specs import validate_spec
from trnflow.workload.memory import plan
from trnflow.workload.recipes import recipe_for
from trnflow.workload.recipes.hf_pretrained import PRETRAINED_CACHE_ENV
from trnflow.workload.recipes.lora import folder_digest

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # moto and transformers: about 20 s

BUCKET = "models"
OTHER_UID = 54321
"""A user other than the one running the tests."""


def _upload(folder: Path, prefix: str) -> str:
    """`folder` under s3://models/prefix with an EXPORTED marker listing its files, as an export has."""
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        name = path.relative_to(folder).as_posix()
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=data)
        files[name] = ExportedFile(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{EXPORT_MARKER}",
                  Body=dump(ExportMarker(recipe={"recipe": "hf-causal-lm", "version": "1"}, files=files)))
    return f"s3://{BUCKET}/{prefix}"


def _spec(url: str, **params):
    return validate_spec(quickstart_data(model={"recipe": "hf-causal-lm", "params": {
        "pretrained": url, "seq_len": 32, **params}}, gate={"metric": "perplexity", "metrics": []}))


@pytest.fixture
def decoder(tmp_path) -> Path:
    return tiny_causal_lm(tmp_path / "decoder", ["a review of a product", "works well, great value"] * 20)


def test_a_folder_on_s3_is_fetched_once_checked_and_named_by_its_digest(in_process_aws, decoder, tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv(PRETRAINED_CACHE_ENV, str(tmp_path / "cache"))
    url = _upload(decoder, "exports/base")
    spec = _spec(url, lora={"r": 4})
    assert spec.model.params["pretrained"] == url  # not made a local path
    memory = plan(spec)  # the planner reads config.json alone
    assert memory.ddp.trainable and not (tmp_path / "cache").exists()

    recipe = recipe_for(spec)
    model = recipe.build_model()
    [copy] = list((tmp_path / "cache").iterdir())
    files = {p.name for p in decoder.iterdir()}
    assert {p.name for p in copy.iterdir()} == files | {EXPORT_MARKER}
    assert copy.name == recipe.base() == folder_digest(decoder)  # its marker's digest is the folder's
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == memory.ddp.trainable

    (copy / "config.json").write_text((copy / "config.json").read_text().replace("}", ', "x": 1}', 1))
    again = recipe_for(spec)
    again.build_model()  # the damaged copy is fetched again
    assert (copy / "config.json").read_bytes() == (decoder / "config.json").read_bytes()


def test_a_copy_or_cache_folder_another_user_owns_is_never_used(in_process_aws, decoder, tmp_path, monkeypatch):
    """On a machine several users share: a copy planted under the cache by another user (its files
    still theirs to change after the check) is fetched again as this user's; a cache folder that
    is another user's is refused."""
    if os.getuid() != 0:
        pytest.skip("giving a file to another user takes root")
    monkeypatch.setenv(PRETRAINED_CACHE_ENV, str(tmp_path / "cache"))
    url = _upload(decoder, "exports/planted")
    planted = tmp_path / "cache" / folder_digest(decoder)
    planted.mkdir(parents=True)
    for path in decoder.iterdir():
        (planted / path.name).write_bytes(path.read_bytes())
    (planted / EXPORT_MARKER).write_bytes(boto3.client("s3").get_object(
        Bucket=BUCKET, Key=f"exports/planted/{EXPORT_MARKER}")["Body"].read())
    os.chown(planted / "model.safetensors", OTHER_UID, OTHER_UID)  # the same bytes, but another user's file
    recipe_for(_spec(url)).build_model()
    assert all(p.stat().st_uid == os.getuid() for p in planted.iterdir())  # fetched again, as this user's
    os.chown(tmp_path / "cache", OTHER_UID, OTHER_UID)
    with pytest.raises(FatalError, match=rf"{tmp_path}/cache belongs to another user \(uid {OTHER_UID}\)"):
        recipe_for(_spec(url)).build_model()
    monkeypatch.delenv(PRETRAINED_CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # the default: the user's own cache folder
    recipe_for(_spec(url)).build_model()
    assert (tmp_path / "xdg" / "trnflow" / "pretrained" / folder_digest(decoder) / "config.json").is_file()


def test_a_file_that_does_not_match_its_marker_stops_the_job(in_process_aws, decoder, tmp_path, monkeypatch):
    monkeypatch.setenv(PRETRAINED_CACHE_ENV, str(tmp_path / "cache"))
    url = _upload(decoder, "exports/swapped")
    boto3.client("s3").put_object(Bucket=BUCKET, Key="exports/swapped/model.safetensors", Body=b"other weights")
    with pytest.raises(FatalError, match=r"model\.params\.pretrained: .*model\.safetensors: does not match its "
                                         "checksum"):
        recipe_for(_spec(url)).build_model()
    assert not any((tmp_path / "cache").glob("*/model.safetensors"))  # nothing half-fetched is left to use


def test_validate_with_data_check_reads_the_marker(in_process_aws, decoder, tmp_path):
    url = _upload(decoder, "exports/base")
    spec = tmp_path / "spec.yaml"
    for target, code in ((url, 0), (f"s3://{BUCKET}/exports/nothing", 2)):
        spec.write_text(json.dumps(quickstart_data(model={"recipe": "hf-causal-lm", "params": {
            "pretrained": target, "seq_len": 32}}, gate={"metric": "perplexity", "metrics": []},
            data={"train": str(tmp_path), "holdout": str(tmp_path), "inference": str(tmp_path)})))
        checked = CliRunner().invoke(app, ["validate", str(spec), "--data-check"])
        said = " ".join(checked.output.split())
        assert ("model.params.pretrained" in said and "has no EXPORTED marker" in said) == (code == 2), said
        plain = " ".join(CliRunner().invoke(app, ["validate", str(spec)]).output.split())
        assert "model.params.pretrained: not checked, on S3" in plain
