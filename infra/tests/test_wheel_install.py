"""trnflow's wheel installed as a user installs it, without extras, in a fresh virtual environment:
the example specs validate, the quickstart pipeline runs on the local backend, and the mocked cloud,
whose moto is only in the `mock` extra, says how to get it instead of failing on an import."""

from __future__ import annotations

import json

import pytest
import yaml
from test_image_install import (  # noqa: F401 (wheel is a fixture)
    EXAMPLES,
    clean_env,
    image_venv,
    install_torch,
    pip,
    run,
    wheel,
)

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    """A fresh venv of the image's Python (trnflow's oldest) with torch, then `pip install <wheel>`."""
    venv_python = image_venv(tmp_path_factory, "wheel")
    venv = venv_python.parents[1]
    install_torch(venv_python)  # first, so that the wheel's torch pin finds it installed
    done = pip(venv_python, "install", str(wheel), cwd=venv.parent)
    assert done.returncode == 0, done.stderr
    return venv_python


def test_every_example_spec_validates(installed, tmp_path):
    examples = sorted(EXAMPLES.glob("*.yaml"))
    checked = run([installed.with_name("trnflow"), "validate", *examples], tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.count("ok ") == len(examples) >= 3
    # and the wheel carries the same examples
    shipped = installed.parents[1].glob("lib/python3.*/site-packages/trnflow/specs/examples/*.yaml")
    assert sorted(p.name for p in shipped) == [p.name for p in examples]


def test_building_the_wheel_gives_no_setuptools_warning(wheel):  # noqa: F811 (the fixture imported above)
    """The package configuration is complete: setuptools finds no package data folder that is not
    declared (its BuildBackendWarning), and nothing deprecated."""
    log = (wheel.parents[1] / "build.log").read_text()
    warnings = [line.strip() for line in log.splitlines()
                if "Warning" in line or ("warning:" in line and "byte-compiling is disabled" not in line)]
    assert warnings == []


def test_the_quickstart_pipeline_runs_on_the_local_backend(installed, tmp_path):
    trnflow = installed.with_name("trnflow")
    synth = run([trnflow, "data", "synth", tmp_path / "data", "--days", "1", "--rows-per-day", "128",
                 "--holdout-rows", "64", "--inference-rows", "48"], tmp_path)
    assert synth.returncode == 0, synth.stderr
    spec = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
    spec["data"].update({name: str(tmp_path / "data" / name) for name in ("train", "holdout", "inference")})
    spec["compute"]["cores_per_node"] = 1
    spec["compile"]["cache_url"] = str(tmp_path / "compile-cache")
    spec["train"].update(steps=2, checkpoint_every=2, log_every=1, checkpoint_url=str(tmp_path / "checkpoints"))
    spec["gate"].update(reference=None, eval_every=None)
    spec["inference"]["output_url"] = str(tmp_path / "embeddings")
    spec["registry_url"] = str(tmp_path / "registry")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    env = clean_env(TRNFLOW_HOME=str(tmp_path / "home"), PREFECT_HOME=str(tmp_path / "prefect"),
                    PREFECT_SERVER_ANALYTICS_ENABLED="false", TRNFLOW_NEURON_RT_DIR=str(tmp_path / "neuron-rt"),
                    TRNFLOW_POLL_SECONDS="0.2")
    ran = run([trnflow, "run", tmp_path / "spec.yaml", "--json"], tmp_path, env)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    outcome = json.loads(ran.stdout)
    assert outcome["state"] == "Completed"
    assert [(s["stage"], s["state"]) for s in outcome["stages"]] == [
        (stage, "Completed") for stage in ("sanity", "collectives", "compile", "train", "evaluate", "infer",
                                           "promote")]
    checkpoint = tmp_path / "checkpoints" / outcome["run_id"] / "step-000002"
    assert outcome["results"]["train"]["checkpoint"] == checkpoint.as_uri()
    assert (checkpoint / "COMMITTED").is_file()
    assert json.loads((tmp_path / "embeddings" / "_current.json").read_text())["folder"] == "v000001"
    manifest = json.loads((tmp_path / "embeddings" / "v000001" / "_manifest.json").read_text())
    assert manifest["rows"] == 48


def test_the_mocked_cloud_needs_the_mock_extra(installed, tmp_path):
    imported = run([installed, "-c", "import moto"], tmp_path)
    assert imported.returncode != 0 and "ModuleNotFoundError" in imported.stderr
    mocked = run([installed.with_name("trnflow"), "mock-aws"], tmp_path)
    assert mocked.returncode != 0
    assert "trnflow[mock]" in mocked.stderr, mocked.stdout + mocked.stderr
