"""`trnflow models export`: a registered version's export copied to a local folder, each file
checked against the marker's checksum, the marker last; a damaged export or a bad folder refused."""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from trnflow.cli.app import app
from trnflow.lifecycle.cards import CARD, README, ExportCard, render
from trnflow.lifecycle.registry import Digests, Registry
from trnflow.records import ADAPTER_FOLDER, DataRead, ExportedFile, ExportMarker, dump, manifest_digest

pytestmark = pytest.mark.unit
runner = CliRunner()

FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\x00weights", "sub/extra.txt": b"x"}


def _export(root, files=FILES, listed=None, **entry):
    folder = root / "run" / "export" / "step-000040"
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    listed = listed or {n: ExportedFile(sha256=hashlib.sha256(d).hexdigest(), size=len(d)) for n, d in files.items()}
    marker = ExportMarker(recipe={"recipe": "hf-causal-lm", "version": "1"}, files=listed)
    (folder / "EXPORTED").write_bytes(dump(marker))
    registry = Registry((root / "registry").as_uri())
    digests = Digests(checkpoint="0" * 64, export=manifest_digest({n: f.model_dump() for n, f in listed.items()}))
    registry.register("lm", {"checkpoint": (root / "run" / "step-000040").as_uri(), "export": folder.as_uri(),
                             "recipe": {"recipe": "hf-causal-lm", "version": "1"}, "digests": digests, **entry})
    registry.promote("lm", 1)
    return folder, ["models", "export", "lm", "-r", str(root / "registry")]


def test_the_champions_export_is_copied_whole_and_checked(tmp_path):
    _, argv = _export(tmp_path)
    out = tmp_path / "out"
    result = runner.invoke(app, [*argv, str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == ["config.json", "model.safetensors", "sub/extra.txt"]
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()
            and p.name != "EXPORTED"} == FILES
    assert set(json.loads((out / "EXPORTED").read_text())["files"]) == set(FILES)


def test_the_card_is_written_again_with_the_gates_verdict_and_the_adapters_names_its_base(tmp_path):
    card = ExportCard(model="lm", run_id="r1", step=40, global_step=40, precision="bf16",
                      recipe={"recipe": "hf-causal-lm", "version": "1",
                              "params": {"pretrained": "runs/base", "lora": {"r": 8, "alpha": 16}}},
                      data=DataRead(files=["a.jsonl"], partitions=["2026-01-01"], watermark="2026-01-01", rows=900),
                      pretrained="runs/base", base="b" * 64)
    files = {**FILES, CARD: card.model_dump_json().encode(), README: render(card).encode(),
             f"{ADAPTER_FOLDER}/{README}": render(card, adapter=True).encode(),
             f"{ADAPTER_FOLDER}/adapter_config.json": b"{}"}
    assert "Not judged when this was written" in files[README].decode()  # training's, before the gate
    _, argv = _export(tmp_path, files=files, status="passed", metrics={"perplexity": 1.25})

    whole = runner.invoke(app, [*argv, str(tmp_path / "out")])
    assert whole.exit_code == 0, whole.output
    said = (tmp_path / "out" / README).read_text()
    assert "A model merged with its LoRA adapter, trained by trnflow" in said and "run `r1`" in said
    assert "Version 1: **passed**" in said and "| perplexity | 1.25 |" in said
    assert "900 rows from 1 file (2026-01-01; watermark 2026-01-01)" in said and "`runs/base`" in said
    listed = json.loads((tmp_path / "out" / "EXPORTED").read_text())["files"]
    assert listed[README]["sha256"] == hashlib.sha256(said.encode()).hexdigest()  # the folder stays whole

    adapter = runner.invoke(app, [*argv, str(tmp_path / "adapter"), "--adapter"])
    assert adapter.exit_code == 0, adapter.output
    card_text = (tmp_path / "adapter" / README).read_text()
    assert card_text.startswith("# lm\n\nA LoRA adapter") and f"`{'b' * 64}`" in card_text
    assert 'PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("runs/base")' in card_text
    assert "Version 1: **passed**" in card_text and "r 8" in card_text
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["EXPORTED", README, "adapter_config.json"]


def test_a_damaged_export_or_a_used_folder_is_refused(tmp_path):
    folder, argv = _export(tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    refused = runner.invoke(app, [*argv, str(used)])
    assert refused.exit_code == 2 and "is not an empty folder" in " ".join(refused.stderr.split())
    (folder / "model.safetensors").write_bytes(b"\x00tampered")
    damaged = runner.invoke(app, [*argv, str(tmp_path / "out")])
    said = " ".join(damaged.stderr.split())
    assert damaged.exit_code == 1 and "model.safetensors: does not match its checksum" in said
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    unknown = runner.invoke(app, [*argv, str(tmp_path / "out"), "--version", "9"])
    assert unknown.exit_code == 2 and "--version 9: lm has no such version" in " ".join(unknown.stderr.split())


def test_a_marker_naming_a_file_outside_the_export_is_refused(tmp_path):
    escape = "../../../registry/lm/champion/g000001.json"
    folder, argv = _export(tmp_path, listed={escape: ExportedFile(sha256="0" * 64, size=1)})
    assert (folder / escape).resolve().is_file()  # a real file of the registry, beside the export
    result = runner.invoke(app, [*argv, str(tmp_path / "out")])
    assert result.exit_code == 1 and "which is not a file inside the export" in " ".join(result.stderr.split())
    assert not (tmp_path / "out").exists()


def test_an_export_rewritten_whole_after_registration_is_refused(tmp_path):
    """A job rewrote a file and its checksum in EXPORTED both: each file matches the marker, and the
    marker is not the one the registry recorded, so nothing is copied."""
    folder, argv = _export(tmp_path)
    swapped = {**FILES, "model.safetensors": b"\x00other weights"}
    (folder / "model.safetensors").write_bytes(swapped["model.safetensors"])
    (folder / "EXPORTED").write_bytes(dump(ExportMarker(recipe={"recipe": "hf-causal-lm", "version": "1"}, files={
        n: ExportedFile(sha256=hashlib.sha256(d).hexdigest(), size=len(d)) for n, d in swapped.items()})))
    result = runner.invoke(app, [*argv, str(tmp_path / "out")])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 1 and "EXPORTED: lists other files than when the model was registered" in said
    assert not (tmp_path / "out").exists()


def test_a_version_registered_by_hand_is_not_exported(tmp_path):
    _, argv = _export(tmp_path)
    registry = Registry((tmp_path / "registry").as_uri())
    registry.register("lm", {"checkpoint": "file:///c/2", "export": "file:///e/2"})
    result = runner.invoke(app, [*argv, str(tmp_path / "out"), "--version", "2"])
    assert result.exit_code == 1 and "registered without a digest of its export" in " ".join(result.stderr.split())
