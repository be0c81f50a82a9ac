"""The model registry on a folder and on S3: versions, one winner per promotion race, rollback, CLI."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from typer.testing import CliRunner

from trnflow.cli.app import app
from trnflow.errors import FatalError
from trnflow.lifecycle.registry import ChampionChange, PromotionConflict, Registry


def _entry(n: int) -> dict:
    return {"checkpoint": f"file:///ckpt/run-{n}/step-000010", "metrics": {"accuracy": 0.7 + n / 100},
            "watermark": f"2026-01-0{n}", "status": "passed"}


def test_versions_are_numbered_and_the_champion_moves_only_by_promotion(tmp_path):
    reg = Registry(tmp_path.as_uri())
    v1, v2 = reg.register("m", _entry(1)), reg.register("m", _entry(2))
    assert (v1.version, v2.version) == (1, 2) and reg.champion("m") is None
    reg.promote("m", 1)
    reg.promote("m", 2, reason="better")
    assert reg.champion("m").version == 2 and reg.champion("m").watermark == "2026-01-02"
    assert [(h.action, h.version, h.previous) for h in reg.history("m")] == [
        ("promote", 1, None), ("promote", 2, 1)]
    assert reg.models() == ["m"]


def test_rollback_goes_back_one_promotion_at_a_time(tmp_path):
    reg = Registry(tmp_path.as_uri())
    for n in (1, 2, 3):
        reg.promote("m", reg.register("m", _entry(n)).version)
    reg.rollback("m")
    assert reg.champion("m").version == 2
    reg.rollback("m")
    assert reg.champion("m").version == 1
    with pytest.raises(FatalError, match="no earlier champion"):
        reg.rollback("m")


def test_a_promotion_decided_on_a_stale_champion_is_refused(tmp_path):
    reg = Registry(tmp_path.as_uri())
    v1, v2 = reg.register("m", _entry(1)), reg.register("m", _entry(2))
    seen = reg.generation("m")
    reg.promote("m", v1.version)
    with pytest.raises(PromotionConflict, match="is now v1"):
        reg.promote("m", v2.version, expected_generation=seen)
    assert reg.champion("m").version == 1


def _race(reg: Registry, contenders: list[int]) -> list:
    seen = reg.generation("m")

    def attempt(version: int):
        try:
            return reg.promote("m", version, expected_generation=seen)
        except PromotionConflict as exc:
            return exc

    with ThreadPoolExecutor(len(contenders)) as pool:
        return list(pool.map(attempt, contenders))


def test_two_concurrent_promotions_on_a_folder_have_one_winner(tmp_path):
    reg = Registry(tmp_path.as_uri())
    versions = [reg.register("m", _entry(n)).version for n in (1, 2)]
    for _ in range(5):
        outcomes = _race(reg, versions)
        winners = [o for o in outcomes if isinstance(o, ChampionChange)]
        assert len(winners) == 1 and sum(isinstance(o, PromotionConflict) for o in outcomes) == 1
        assert reg.champion("m").version == winners[0].version


def test_two_concurrent_promotions_on_s3_have_one_winner(s3_bucket):
    reg = Registry(f"s3://{s3_bucket}/registry")
    versions = [reg.register("m", _entry(n)).version for n in (1, 2)]
    outcomes = _race(reg, versions)
    assert sum(isinstance(o, ChampionChange) for o in outcomes) == 1
    assert len(reg.history("m")) == 1


def test_two_processes_registering_at_once_get_different_versions(tmp_path):
    script = ("import sys; from trnflow.lifecycle.registry import Registry; "
              f"print(Registry({tmp_path.as_uri()!r}).register('m', {{'checkpoint': sys.argv[1]}}).version)")
    procs = [subprocess.Popen([sys.executable, "-c", script, f"c{i}"], stdout=subprocess.PIPE, text=True)
             for i in range(4)]
    numbers = sorted(int(p.communicate()[0]) for p in procs)
    assert numbers == [1, 2, 3, 4]


def _committed(root, n: int) -> dict:
    """`_entry(n)` for a checkpoint folder that exists, registered with its digests as a run registers it."""
    from tests.factories import commit
    from trnflow.lifecycle.digests import registered_digests

    folder = root / "ckpt" / f"run-{n}" / "step-000010"
    folder.mkdir(parents=True)
    (folder / "model.pt").write_bytes(f"weights {n}".encode())
    commit(folder)
    return {**_entry(n), "checkpoint": folder.as_uri(), "digests": registered_digests(folder.as_uri(), None)}


def test_models_commands_list_show_promote_and_roll_back(tmp_path):
    reg = Registry((tmp_path / "registry").as_uri())
    for n in (1, 2):
        reg.register("m", _committed(tmp_path, n))
    tmp_path = tmp_path / "registry"
    runner = CliRunner()
    where = ["--registry", str(tmp_path)]
    assert runner.invoke(app, ["models", "promote", "m", "1", *where]).exit_code == 0
    result = runner.invoke(app, ["models", "promote", "m", "2", *where, "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["previous"] == 1
    rows = json.loads(runner.invoke(app, ["models", "ls", *where, "--json"]).stdout)
    assert [(r["version"], r["champion"]) for r in rows] == [(1, False), (2, True)]
    shown = json.loads(runner.invoke(app, ["models", "show", "m", *where, "--json"]).stdout)
    assert shown["entry"]["version"] == 2 and len(shown["history"]) == 2
    result = runner.invoke(app, ["models", "rollback", "m", *where])
    assert result.exit_code == 0 and "v1 is the champion again" in result.stdout
    missing = runner.invoke(app, ["models", "show", "m", "9", *where])
    assert missing.exit_code == 1 and "not in the registry" in missing.stderr


def test_a_version_whose_files_changed_after_registration_is_neither_promoted_nor_rolled_back_to(tmp_path):
    """A job swapped v1's weights and rewrote its COMMITTED to match: the registry's record of v1
    no longer does, so neither command makes it champion; a version registered by hand has no
    record, and is refused too."""
    import hashlib

    reg = Registry((tmp_path / "registry").as_uri())
    for n in (1, 2):
        reg.register("m", _committed(tmp_path, n))
    reg.register("m", _entry(3))
    where = ["--registry", str(tmp_path / "registry")]
    runner = CliRunner()
    assert runner.invoke(app, ["models", "promote", "m", "1", *where]).exit_code == 0
    assert runner.invoke(app, ["models", "promote", "m", "2", *where]).exit_code == 0
    folder = tmp_path / "ckpt" / "run-1" / "step-000010"
    (folder / "model.pt").write_bytes(b"other weights")
    swapped = runner.invoke(app, ["models", "rollback", "m", *where])
    said = " ".join(swapped.stderr.split())
    assert swapped.exit_code == 1 and "m v1:" in said and "model.pt: does not match its checksum" in said
    data = b"other weights"
    (folder / "COMMITTED").write_text(json.dumps({"files": {"model.pt": {
        "sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}}}))
    rewritten = runner.invoke(app, ["models", "rollback", "m", *where])
    said = " ".join(rewritten.stderr.split())
    assert rewritten.exit_code == 1 and "m v1:" in said and "COMMITTED lists other files than when it was" in said
    by_hand = runner.invoke(app, ["models", "promote", "m", "3", *where])
    assert by_hand.exit_code == 1 and "m v3: registered without digests" in " ".join(by_hand.stderr.split())
    assert reg.champion("m").version == 2 and len(reg.history("m")) == 2  # nothing changed


def test_a_truncated_version_file_is_named_and_the_intact_versions_are_listed(tmp_path):
    """Item 16: one version file cut short. `models ls` names it and what to do, lists the other
    versions, and exits non-zero; reading the champion through it names the file too."""
    reg = Registry(tmp_path.as_uri())
    for n in (1, 2, 3):
        reg.register("m", _entry(n))
    reg.promote("m", 2)
    bad = tmp_path / "m" / "versions" / "v000002.json"
    bad.write_bytes(bad.read_bytes()[:72])
    result = CliRunner().invoke(app, ["models", "ls", "m", "-r", str(tmp_path), "--json"])
    assert result.exit_code == 1
    assert [r["version"] for r in json.loads(result.stdout)] == [1, 3]
    assert "v000002.json: corrupt registry file" in result.stderr and "Restore it" in result.stderr
    with pytest.raises(FatalError, match=r"v000002\.json: corrupt registry file"):
        reg.champion("m")


def test_a_truncated_champion_record_fails_the_location_check_before_training(make_spec):
    """Item 16: the check every training run makes first names the corrupt file."""
    from trnflow.lifecycle.locations import check_locations

    spec = make_spec(gate={"reference": None})
    reg = Registry(spec.registry_url)
    reg.register(spec.name, _entry(1))
    reg.promote(spec.name, 1)
    check_locations(spec)
    record = next((reg.store.root / spec.name / "champion").iterdir())
    record.write_text(record.read_text()[:40])
    with pytest.raises(FatalError, match=r"registry_url: .*g000001\.json: corrupt registry file"):
        check_locations(spec)


def test_an_output_location_that_cannot_be_written_fails_the_check_before_training(make_spec, tmp_path):
    """Items 16 and 18: an output location that cannot be written (here a folder inside a file, which
    not even root can create) is found before any training, by field name."""
    from trnflow.lifecycle.locations import check_locations

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the output folder's parent should be")
    with pytest.raises(FatalError, match=r"inference.output_url .*not-a-folder/out: cannot be written"):
        check_locations(make_spec(inference={"output_url": str(blocker / "out")}))
