"""Every typed file that crosses rooms, fed a malformed copy: the error names the file and the field."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tests.factories import checkpoint_meta
from trnflow.cli.app import app
from trnflow.errors import DataError, FatalError
from trnflow.lifecycle.judge import meta_of
from trnflow.lifecycle.registry import Registry
from trnflow.records import RecordError, Verdict, dump, read
from trnflow.workload.checkpoint import RunCheckpoints, load

runner = CliRunner()


def _checkpoint(tmp_path, meta: bytes) -> str:
    """A committed checkpoint whose meta.json is `meta` (its marker's checksums made to match)."""
    url = RunCheckpoints((tmp_path / "run").as_uri()).save(
        10, {"w": torch.zeros(2)}, {"state": {}, "param_groups": []}, [{"torch": torch.get_rng_state()}],
        ("tokenizer.json", b"{}"), checkpoint_meta(step=10))
    folder = tmp_path / "run" / "step-000010"
    (folder / "meta.json").write_bytes(meta)
    marker = json.loads((folder / "COMMITTED").read_text())
    import hashlib
    marker["files"]["meta.json"] = {"sha256": hashlib.sha256(meta).hexdigest(), "size": len(meta)}
    (folder / "COMMITTED").write_text(json.dumps(marker))
    return url


def test_a_checkpoint_meta_with_a_wrong_field_is_named_by_training_and_the_gate(tmp_path):
    meta = json.loads(dump(checkpoint_meta(step=10)))
    meta["data"]["rows"] = "many"
    url = _checkpoint(tmp_path, json.dumps(meta).encode())
    for reader in (lambda: load(url), lambda: meta_of(url)):
        with pytest.raises(DataError, match=r"step-000010/meta\.json: not a CheckpointMeta \(data\.rows: "):
            reader()


def test_a_checkpoint_meta_from_another_version_is_refused_by_its_unknown_field(tmp_path):
    meta = {**json.loads(dump(checkpoint_meta(step=10))), "plain_state_dict": True}
    url = _checkpoint(tmp_path, json.dumps(meta).encode())
    with pytest.raises(DataError, match=r"meta\.json: .*plain_state_dict: Extra inputs are not permitted.*earlier one"):
        load(url)


def test_a_verdict_with_a_wrong_field_names_it():
    good = {"metric": "accuracy", "mode": "final", "max_abs_diff": 0.001, "passed": True,
            "points": [{"step": 1, "global_step": 1, "candidate": 0.5, "reference": 0.5, "diff": 0, "passed": True}]}
    assert read(Verdict, json.dumps(good), "verdict.json").points[0].diff == 0
    bad = {**good, "points": [{**good["points"][0], "candidate": "high"}]}
    with pytest.raises(RecordError, match=r"verdict\.json: not a Verdict \(points\.0\.candidate: "):
        read(Verdict, json.dumps(bad), "verdict.json")


def test_a_registry_entry_with_a_string_accuracy_is_named_by_models_ls(tmp_path):
    reg = Registry(tmp_path.as_uri())
    reg.register("m", {"checkpoint": "file:///c/1", "metrics": {"accuracy": 0.8}})
    reg.register("m", {"checkpoint": "file:///c/2", "metrics": {"accuracy": 0.9}})
    crafted = tmp_path / "m" / "versions" / "v000002.json"
    crafted.write_text(crafted.read_text().replace('"accuracy": 0.9', '"accuracy": "0.9"'))
    result = runner.invoke(app, ["models", "ls", "m", "-r", str(tmp_path), "--json"])
    assert result.exit_code == 1 and not isinstance(result.exception, ValueError)
    assert [r["version"] for r in json.loads(result.stdout)] == [1]
    said = " ".join(result.stderr.split())  # however wide the console wraps it
    assert "v000002.json: corrupt registry file" in said and "metrics.accuracy" in said


def test_a_champion_history_that_starts_with_a_rollback_is_named_by_models_rollback(tmp_path):
    reg = Registry(tmp_path.as_uri())
    for n in (1, 2):
        reg.register("m", {"checkpoint": f"file:///c/{n}"})
    reg.promote("m", 1)
    reg.promote("m", 2)
    first = tmp_path / "m" / "champion" / "g000001.json"
    first.write_text(first.read_text().replace('"promote"', '"rollback"'))
    result = runner.invoke(app, ["models", "rollback", "m", "-r", str(tmp_path)])
    assert result.exit_code != 0 and not isinstance(result.exception, IndexError)
    said = " ".join(result.stderr.split())
    assert "g000001.json: corrupt registry file" in said and "action" in said
    with pytest.raises(FatalError, match=r"g000001\.json.*action: a rollback with no promotion before it"):
        reg.rollback_target("m")


def test_a_champion_record_with_an_unknown_action_names_the_field(tmp_path):
    reg = Registry(tmp_path.as_uri())
    reg.register("m", {"checkpoint": "file:///c/1"})
    reg.promote("m", 1)
    record = tmp_path / "m" / "champion" / "g000001.json"
    record.write_text(record.read_text().replace('"promote"', '"demote"'))
    with pytest.raises(FatalError, match=r"g000001\.json: corrupt registry file \(not a ChampionChange \(action: "):
        reg.champion("m")


def test_a_job_result_with_a_field_its_phase_does_not_know_names_it():
    from trnflow.backends.base import stage_result

    good = {"phase": "promote", "version": 3, "summary": "champion v3"}
    assert stage_result("j1", json.dumps(good), [0, 1]).cores == [0, 1]
    with pytest.raises(RecordError, match=r"job j1: result\.json: not a PromoteResult \(verison: Extra inputs"):
        stage_result("j1", json.dumps({**good, "verison": 4}), None)
    with pytest.raises(RecordError, match=r"job j2: result\.json: phase: 'tune' is none of"):
        stage_result("j2", json.dumps({"phase": "tune"}), None)


def test_a_ranks_failure_report_with_a_wrong_field_names_the_file(tmp_path):
    from trnflow.backends.failures import read_reports

    (tmp_path / "failure-rank0.json").write_text(json.dumps({"rank": 0, "type": "HardwareError", "message": "nc0",
                                                             "retryable": True, "bad_cores": [0]}))
    (report,) = read_reports(tmp_path)
    assert report.bad_cores == [0] and report.reported_at is not None
    (tmp_path / "failure-rank1.json").write_text(json.dumps({"rank": 1, "type": "HardwareError", "bad_cores": "nc1"}))
    with pytest.raises(RecordError, match=r"failure-rank1\.json: not a FailureReport \(bad_cores: "):
        read_reports(tmp_path)
