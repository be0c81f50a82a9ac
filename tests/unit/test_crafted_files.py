"""Files another job or person could have written, crafted to break trnflow: whatever they hold,
trnflow names the file and what is wrong, prints their text as text, and never fails with a
traceback. The readers are fuzzed with hypothesis."""

import json
import os
import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from trnflow.cli.app import app
from trnflow.device.cache import COMPILER_VERSION, LOCKED, CompileCache, entry_name
from trnflow.device.cache_index import INDEX
from trnflow.device.cache_lock import STALE_LOCK_SECONDS
from trnflow.errors import TrnflowError
from trnflow.lifecycle.registry import Registry
from trnflow.processes import pid_alive
from trnflow.specs import SpecError, parse_spec, validate_spec

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                max_size=4),
                    max_leaves=12)
CONTENT = st.one_of(
    st.binary(max_size=200),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.builds(lambda fields: json.dumps(fields).encode(),
              st.dictionaries(st.sampled_from(["pid", "since", "host", "token", "files", "step", "version", "model",
                                               "generation", "action", "metrics", "status", "rows", "format"]),
                              JSON, max_size=6)),
    st.just(b'{"pid": ' + b"9" * 5000 + b"}"),  # past Python's integer digit limit
)


# --- printed as text ----------------------------------------------------------------------------

def test_markup_and_escape_codes_in_a_registry_print_as_text(tmp_path, monkeypatch):
    from rich.console import Console

    from trnflow.cli import models

    monkeypatch.setattr(models, "console", Console(width=250))  # every cell whole, however the tests are run
    registry = Registry(tmp_path.as_uri())
    registry.register("m", {"checkpoint": "file:///c/1", "watermark": "[i]w[/i]\x1b[2J"})
    registry.promote("m", 1, reason="[bold red]urgent[/bold red] \x1b]8;;https://evil.example\x07click")
    listed = CliRunner().invoke(app, ["models", "ls", "m", "-r", tmp_path.as_uri()])
    shown = CliRunner().invoke(app, ["models", "show", "m", "-r", tmp_path.as_uri()])
    assert listed.exit_code == 0 and shown.exit_code == 0, listed.output + shown.output
    assert "[i]w[/i] " in listed.output  # the text, not italics; the screen-clearing sequence removed
    assert "[bold red]urgent[/bold red] click" in shown.output  # the link sequence removed, its text kept
    for output in (listed.output, shown.output):
        assert "\x1b" not in output and "\x07" not in output and "evil.example" not in output


# --- locks --------------------------------------------------------------------------------------

def _lock(root, key: str, record: dict) -> str:
    entry = entry_name(key)
    (root / entry).mkdir(parents=True, exist_ok=True)
    (root / entry / "model.lock").write_text(json.dumps(record))
    return entry


def test_a_lock_naming_no_possible_process_or_held_past_its_lease_is_free(tmp_path):
    host, now = socket.gethostname(), time.time()
    cache = CompileCache(str(tmp_path))
    huge = _lock(tmp_path, "MODULE_1+1", {"pid": 10**30, "host": host, "since": now})
    init = _lock(tmp_path, "MODULE_2+2", {"pid": 1, "host": host, "since": now - STALE_LOCK_SECONDS - 1})
    held = _lock(tmp_path, "MODULE_3+3", {"pid": 1, "host": host, "since": now})  # pid 1 never ends
    assert not pid_alive(10**30) and not pid_alive(-5)
    assert cache.lock_owner(huge) is None and cache.lock_owner(init) is None
    assert cache.lock_owner(held) is not None and cache.state(held) == LOCKED
    assert cache.acquire_lock(init) is True  # a lock past its lease is broken, not waited on for ever
    listed = CliRunner().invoke(app, ["cache", "ls", str(tmp_path)])
    assert listed.exit_code == 0 and "MODULE_1+1" in listed.output, listed.output


@pytest.mark.slow  # 40 files each, written and read: with the integration tests
@FUZZ
@given(content=CONTENT)
def test_any_lock_file_is_a_state_or_a_clear_error(tmp_path, content):
    entry = entry_name("MODULE_9+9")
    (tmp_path / entry).mkdir(parents=True, exist_ok=True)
    (tmp_path / entry / "model.lock").write_bytes(content)
    cache = CompileCache(str(tmp_path))
    try:
        assert cache.state(entry) in ("locked", "missing")
    except TrnflowError as exc:  # garbled: named, and no compile holds it
        assert "model.lock: a garbled lock record" in str(exc) and len(str(exc)) < 400
        assert cache.acquire_lock(entry) is True  # cleared by the next compile
    assert CliRunner().invoke(app, ["cache", "ls", str(tmp_path), "--json"]).exit_code in (0, 2)


# --- the cache's small files and its index --------------------------------------------------------

@pytest.mark.slow  # 40 files each, written and read: with the integration tests
@FUZZ
@given(record=CONTENT, usage=CONTENT, index=CONTENT)
def test_any_record_usage_or_index_file_lists_without_a_traceback(tmp_path, record, usage, index):
    entry = tmp_path / entry_name("MODULE_8+8")
    entry.mkdir(parents=True, exist_ok=True)
    for name, data in (("model.fx.txt", b"g"), ("model.neff", b"x"), ("model.done", b""), ("trnflow.json", record),
                       ("usage.json", usage)):
        (entry / name).write_bytes(data)
    (tmp_path / COMPILER_VERSION / INDEX).write_bytes(index)
    cache = CompileCache(str(tmp_path))
    for deep in (False, True):
        [found] = cache.entries(deep=deep)
        assert found.state in ("done", "corrupt")
        assert isinstance(found.hits, int)
    assert CliRunner().invoke(app, ["cache", "verify", str(tmp_path)]).exit_code in (0, 1)


# --- the registry -------------------------------------------------------------------------------

@pytest.mark.slow  # 40 files each, written and read: with the integration tests
@FUZZ
@given(version=CONTENT, change=CONTENT)
def test_any_registry_file_is_read_or_named(tmp_path, version, change):
    (tmp_path / "m" / "versions").mkdir(parents=True, exist_ok=True)
    (tmp_path / "m" / "champion").mkdir(parents=True, exist_ok=True)
    (tmp_path / "m" / "versions" / "v000001.json").write_bytes(version)
    (tmp_path / "m" / "champion" / "g000001.json").write_bytes(change)
    registry = Registry(tmp_path.as_uri())
    for read in (lambda: registry.readable("m"), lambda: registry.champion("m"), lambda: registry.history("m"),
                 lambda: registry.rollback_target("m")):
        try:
            read()
        except TrnflowError as exc:
            assert "v000001.json" in str(exc) or "g000001.json" in str(exc) or "m" in str(exc)
    for command in (["models", "ls", "-r", tmp_path.as_uri()], ["models", "show", "m", "-r", tmp_path.as_uri()]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code in (0, 1, 2) and "Traceback" not in result.output, result.output


# --- checkpoint markers -------------------------------------------------------------------------

def _checkpoint(tmp_path, marker: bytes):
    folder = tmp_path / "run" / "step-00000010"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("model.pt", "optim.pt", "state.pt", "meta.json", "tokenizer.json"):
        (folder / name).write_bytes(b"x")
    (folder / "COMMITTED").write_bytes(marker)
    return folder


@pytest.mark.parametrize("stray", ["../../x", "/etc/passwd", "a/../../b", ""])
def test_a_marker_that_lists_a_file_outside_its_folder_skips_the_checkpoint(tmp_path, stray):
    from trnflow.workload.checkpoint import RunCheckpoints, load

    files = {n: {"sha256": "0" * 64, "size": 1} for n in ("model.pt", "optim.pt", "state.pt", "meta.json", stray)}
    folder = _checkpoint(tmp_path, json.dumps({"step": 10, "files": files}).encode())
    with pytest.raises(TrnflowError, match="not a file of the checkpoint's folder; the checkpoint is damaged or "
                                           "tampered with, so it is skipped"):
        load(folder.as_uri())
    skipped = []
    assert RunCheckpoints((tmp_path / "run").as_uri()).latest(lambda url, why: skipped.append(why)) is None
    assert len(skipped) == 1 and not (tmp_path / "x").exists()


@FUZZ
@given(marker=CONTENT)
def test_any_checkpoint_marker_is_loaded_or_named(tmp_path, marker):
    from trnflow.workload.checkpoint import RunCheckpoints, load

    folder = _checkpoint(tmp_path, marker)
    with pytest.raises(TrnflowError, match="step-00000010"):
        load(folder.as_uri())
    os.makedirs(tmp_path / "run" / "step-notanumber", exist_ok=True)
    (tmp_path / "run" / "step-notanumber" / "COMMITTED").write_bytes(marker)
    assert RunCheckpoints((tmp_path / "run").as_uri()).latest() is None


# --- numbers in a spec --------------------------------------------------------------------------

@pytest.mark.parametrize(("section", "value", "says"), [
    ({"train": {"seed": 2**63}}, None, "train.seed: Input should be less than or equal to 9223372036854775807"),
    ({"train": {"steps": 10**12}}, None, "train.steps: Input should be less than or equal to 1000000000"),
    ({"train": {"global_batch_size": 2**40}}, None, "train.global_batch_size"),
    ({"inference": {"shard_size": 10**12}}, None, "inference.shard_size"),
    ({"train": {"lr": float("inf")}}, None, "train.lr: Input should be a finite number"),
])
def test_every_number_in_a_spec_is_bounded(section, value, says):
    data = quickstart_data()
    for name, fields in section.items():
        data[name] = {**data.get(name, {}), **fields}
    with pytest.raises(SpecError) as refused:
        validate_spec(data)
    assert says in str(refused.value)


def test_a_five_thousand_digit_number_is_one_line(tmp_path):
    text = "name: quickstart\ntrain:\n  seed: " + "7" * 5000 + "\n"
    with pytest.raises(SpecError) as refused:
        parse_spec(text, "crafted.yaml")
    assert refused.value.problems == ["(file): a value cannot be read (Exceeds the limit (4300 digits) for integer "
                                      "string conversion: value has 5000 digits); no field takes a number that long"]
    spec = tmp_path / "crafted.yaml"
    spec.write_text(text)
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2 and "Traceback" not in result.output
