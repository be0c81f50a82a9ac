"""Item 19: a `trnflow run` stopped by SIGTERM names its run and the exact command that resumes it."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trnflow.storage import local_path
from trnflow.workload.checkpoint import MARKER

TRNFLOW = Path(sys.executable).parent / "trnflow"


@pytest.mark.slow
def test_a_terminated_run_prints_its_id_and_the_command_that_resumes_it(make_spec, warm_compile_cache, tmp_path):
    spec = make_spec(cores=1, name="stopped", train={"steps": 4000, "checkpoint_every": 20, "log_every": 20},
                     gate={"reference": None})
    path = tmp_path / "stopped.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", exclude_none=True), sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    proc = subprocess.Popen([str(TRNFLOW), "run", str(path), "--set", "train.log_every=40"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    checkpoints = local_path(spec.train.checkpoint_url)
    deadline = time.monotonic() + 600
    while not list(checkpoints.glob(f"*/step-*/{MARKER}")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    (run_dir,) = [p for p in checkpoints.iterdir() if p.is_dir()]
    assert proc.returncode == 130, stderr
    assert f"interrupted: run {run_dir.name} stopped" in stderr
    assert f"trnflow run {path} --set train.log_every=40 --run-id {run_dir.name}" in " ".join(stderr.split())
