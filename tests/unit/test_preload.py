"""What a process that forks ranks imports for them first (`trnflow.workload.__main__.preload`): what
each phase's ranks would otherwise load for themselves, and (`preload_recipe`) the libraries a
recipe declares in `Recipe.preloads`, for the phases that build its model; for trnflow's own
recipes only, in the fork server that outlives its jobs; and never a failure."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import quickstart_data

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # a new interpreter, which imports torch

PROBE = """
import json, sys
from pathlib import Path
from trnflow.workload.__main__ import preload_recipe

seen = []
for phase, spec, own_only in json.loads(sys.argv[1]):
    preload_recipe(phase, Path(spec), own_only=own_only)
    seen.append(sorted(m for m in ("transformers.modeling_utils", "peft", "tabular_recipe") if m in sys.modules))
print(json.dumps(seen))
"""


def test_a_recipes_libraries_are_imported_for_the_phases_that_build_its_model(tmp_path):
    def spec(name: str, recipe: str, **params) -> str:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(quickstart_data(model={"recipe": recipe, "params": params})))
        return str(path)

    quickstart = spec("quickstart", "m5-text")
    hf = spec("hf", "hf-causal-lm", model_type="llama", vocab_size=300, seq_len=16)
    tabular = spec("tabular", "tabular-mlp")
    (tmp_path / "broken.json").write_text("{not json")
    steps = [
        ("train", quickstart, False),                   # a recipe without preloads: nothing
        ("sanity", hf, False),                          # a phase that builds no model: nothing
        ("train", str(tmp_path / "broken.json"), False),  # unreadable: left to the job to say so
        ("train", str(tmp_path / "missing.json"), False),
        ("train", tabular, True),                       # a plug-in, in a process that outlives its jobs
        ("train", tabular, False),                      # a plug-in in a job's launcher: its module
        ("train", hf, True),                            # trnflow's own: transformers and peft
    ]
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(steps)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [
        [], [], [], [], [], ["tabular_recipe"], ["peft", "tabular_recipe", "transformers.modeling_utils"]]


PHASES_PROBE = """
import json, sys
from trnflow.workload.__main__ import preload

WATCHED = ("trnflow.workload.collectives", "pandas", "torch._dynamo", "torch._dynamo.repro.after_dynamo")
seen = []
for phase in sys.argv[1:]:
    preload([phase])
    names = {}
    if "torch._dynamo" in sys.modules:
        from torch._dynamo import funcname_cache
        names = funcname_cache.cache
    seen.append([m for m in WATCHED if m in sys.modules] + [len(names) > 0])
print(json.dumps(seen))
"""


def test_what_each_phases_ranks_would_load_for_themselves_is_loaded_before_they_are_forked():
    """A phase's module; pyarrow's first conversion of Python values (which imports pandas) for the
    phases that read data; TorchDynamo, the wrappers torch.compile imports at its first call, and
    the function names of torch.nn.functional's lines, for the phases that compile."""
    done = subprocess.run([sys.executable, "-c", PHASES_PROBE, "collectives", "compile", "infer"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [
        ["trnflow.workload.collectives", False],  # no data, no compiling: neither is loaded
        ["trnflow.workload.collectives", "torch._dynamo", "torch._dynamo.repro.after_dynamo", True],
        ["trnflow.workload.collectives", "pandas", "torch._dynamo", "torch._dynamo.repro.after_dynamo", True]]
