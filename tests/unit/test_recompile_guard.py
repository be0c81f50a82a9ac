"""compile.max_recompiles: the guard every device's compile backend reports recompilations to."""

import pytest

from tests.conftest import quickstart_data
from trnflow.device.base import RecompileGuard
from trnflow.errors import Recompilation
from trnflow.specs import SpecError, validate_spec


def _compile(**values):
    return validate_spec(quickstart_data(compile=values)).compile


def test_the_run_stops_at_the_recompilation_over_the_limit_and_names_its_shapes():
    guard = RecompileGuard(limit=2)
    guard.recompiled("train_step", "MODULE_a+1", "tokens [8, 32] int64", "it is not in the compile cache", "c")
    guard.recompiled("eval_step", "MODULE_b+1", "tokens [4, 32] int64", "it is not in the compile cache", "c")
    with pytest.raises(Recompilation) as over:
        guard.recompiled("train_step", "MODULE_c+1", "tokens [7, 32] int64", "it is not in the compile cache", "c")
    message = str(over.value)
    assert "MODULE_c+1 for inputs tokens [7, 32] int64" in message
    assert "recompilation 3, over compile.max_recompiles (2)" in message and "drop_last" in message


def test_without_a_limit_recompilations_are_only_counted():
    guard = RecompileGuard()
    for n in range(50):
        guard.recompiled("embed_step", f"MODULE_{n}+1", "tokens [1, 32] int64", "new shape", "c")
    assert guard.count == 50


def test_the_spec_gives_one_limit():
    assert _compile().recompile_limit is None
    assert _compile(max_recompiles=3).recompile_limit == 3
    assert _compile(fail_on_recompile=True).recompile_limit == 0  # the older spelling of max_recompiles: 0
    assert _compile(fail_on_recompile=True, max_recompiles=0).recompile_limit == 0
    with pytest.raises(SpecError, match="set only one of them"):
        _compile(fail_on_recompile=True, max_recompiles=2)
    with pytest.raises(SpecError, match=r"compile\.max_recompiles"):
        _compile(max_recompiles=-1)
