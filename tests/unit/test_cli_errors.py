"""The documented error cases, each through the command's own exit handling (`trnflow.cli.main`):
one message and its exit code, never a traceback. A bug alone gets its traceback, and a line
asking for a report."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import quickstart_data
from trnflow.cli.app import app
from trnflow.cli.main import BUG, outcome
from trnflow.errors import ChampionKept, ExitCode, GateFailed
from trnflow.lifecycle.registry import PromotionConflict, Registry


def _run(capsys, *args: str) -> tuple[int, str]:
    code = outcome(lambda: app(args=list(args), prog_name="trnflow", standalone_mode=False))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _spec(tmp_path, **sections) -> str:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(**sections)))
    return str(path)


CASES = {
    "a spec file that is not there": (lambda tmp: ["run", str(tmp / "nope.yaml")], ExitCode.BAD_INPUT, "not found"),
    "a bad field": (lambda tmp: ["validate", _spec(tmp, train={"steps": 0})], ExitCode.BAD_INPUT, "train.steps"),
    "a location the backend cannot use": (
        lambda tmp: ["run", _spec(tmp, gate={"reference": None}), "--backend", "batch"], ExitCode.BAD_INPUT,
        "is not on S3"),
    "a recipe that cannot be imported": (
        lambda tmp: ["validate", _spec(tmp, model={"recipe": "no_such_package.models:Thing", "params": {}})],
        ExitCode.BAD_INPUT, "model.recipe"),
    "a recipe named by a module, which the settings do not allow": (
        lambda tmp: ["validate", _spec(tmp, model={"recipe": "this:X", "params": {}})], ExitCode.BAD_INPUT,
        "set TRNFLOW_RECIPE_MODULES=1 where every spec is trusted"),
    "a malformed recipe": (
        lambda tmp: ["validate", _spec(tmp, model={"recipe": ".foo:X", "params": {}})], ExitCode.BAD_INPUT,
        "model.recipe: '.foo:X' is not package.module:attr"),
    "local data that is not there": (
        lambda tmp: ["run", _spec(tmp, data={"train": str(tmp / "none"), "holdout": str(tmp), "inference": str(tmp)},
                                  gate={"reference": None})], ExitCode.BAD_INPUT, "data.train"),
    "a missing gate reference": (
        lambda tmp: ["retrain", _spec(tmp, gate={"reference": str(tmp / "missing.json")})], ExitCode.BAD_INPUT,
        "gate.reference"),
    "a usage mistake": (lambda tmp: ["run", "--no-such-option"], ExitCode.BAD_INPUT, "No such option"),
    "an unknown command": (lambda tmp: ["trian"], ExitCode.BAD_INPUT, "No such command"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_expected_failure_is_one_message_and_its_exit_code(case, tmp_path, capsys):
    argv, code, says = CASES[case]
    got, text = _run(capsys, *argv(tmp_path))
    assert got == code, text
    assert says in " ".join(text.split()) and "Traceback" not in text and BUG not in text


def test_a_damaged_registry_file_is_named_without_a_traceback(tmp_path, capsys):
    registry = Registry(tmp_path.as_uri())
    registry.register("m", {"checkpoint": "file:///c/1"})
    registry.promote("m", 1)
    (tmp_path / "m" / "champion" / "g000001.json").write_text('{"generation": 1}')
    code, text = _run(capsys, "models", "show", "m", "-r", str(tmp_path))
    assert code == ExitCode.FAILED and "g000001.json: corrupt registry file" in text and "Traceback" not in text


def test_a_bug_shows_its_traceback_and_asks_for_a_report():
    """Through the installed entry point: a command that raises what nobody expected."""
    script = ("import sys\nfrom trnflow.cli import app, main\n"
              "@app.app.command('explode')\ndef explode():\n    raise RuntimeError('a bug')\n"
              "sys.argv = ['trnflow', 'explode']\nmain.main()\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == ExitCode.BUG
    assert "Traceback" in done.stderr and "RuntimeError: a bug" in done.stderr and BUG in done.stderr


def _raises(exc: BaseException):
    def command():
        raise exc
    return command


@pytest.mark.parametrize("exc, code", [
    (ConnectionError("the Prefect server at 127.0.0.1:4200 did not answer"), ExitCode.FAILED),
    (TimeoutError("timed out"), ExitCode.FAILED),
    (GateFailed("accuracy outside the band"), ExitCode.GATE_FAILED),
    (ChampionKept("worse than the champion"), ExitCode.CHAMPION_KEPT),
    (PromotionConflict("the champion changed meanwhile"), ExitCode.CONFLICT),
])
def test_failures_outside_trnflow_and_its_own_decisions_are_one_line_with_their_exit_codes(exc, code, capsys):
    assert outcome(_raises(exc)) == code
    text = capsys.readouterr().err
    assert str(exc) in text and "Traceback" not in text and BUG not in text


def test_the_clouds_answers_are_not_bugs(capsys):
    from botocore.exceptions import ClientError, NoCredentialsError

    denied = ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}, "PutObject")
    for exc in (NoCredentialsError(), denied):
        assert outcome(_raises(exc)) == ExitCode.FAILED
        text = capsys.readouterr().err
        assert type(exc).__name__ in text and "Traceback" not in text
