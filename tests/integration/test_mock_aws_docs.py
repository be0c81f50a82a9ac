"""Item 14: the mock cloud as the README and docs/cloud.md show it. `trnflow mock-aws` serves the
Batch example, the page's boto3 snippet runs as written with no AWS credentials configured
against the bucket and queue it names, and stopping the server removes its temporary folder.
The run talks to the session's Prefect API, as a user's does once a server is configured."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRNFLOW = Path(sys.executable).with_name("trnflow")
SHORTER = ["--set", "train.steps=10", "--set", "train.checkpoint_every=10", "--set", "gate.eval_every=10"]
"""The README's example with fewer steps: the same jobs, graphs and requests."""


def _snippet() -> str:
    (code,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "cloud.md").read_text(), re.DOTALL)
    return code


def _started(server: subprocess.Popen) -> str:
    """What the server printed up to its ready message."""
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any("In another shell" in line for line in lines):
        line = server.stdout.readline()
        assert line or server.poll() is None, "".join(lines)
        lines.append(line)
    return "".join(lines)


@pytest.mark.slow
def test_the_batch_example_runs_on_the_mock_cloud_and_the_docs_snippet_reads_it(tmp_path, prefect_api):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TRNFLOW_", "PREFECT_"))}
    env |= {"HOME": str(tmp_path), "COLUMNS": "400", "TMPDIR": str(tmp_path),  # no ~/.aws: no credentials
            "PREFECT_HOME": str(tmp_path / "prefect"), "TRNFLOW_HOME": str(tmp_path / "trnflow"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TRNFLOW_POLL_SECONDS": "0.2"}
    server = subprocess.Popen([str(TRNFLOW), "mock-aws", "--port", str(port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        printed = _started(server)
        (jobs,) = re.findall(r"jobs run under (\S+)", printed)
        work = Path(jobs).parent
        assert work.is_dir() and "s3://trnflow-data-123456789012" in printed
        endpoint = f"http://127.0.0.1:{port}"
        ran = subprocess.run([str(TRNFLOW), "run", "jobspecs/examples/quickstart-batch.yaml", *SHORTER, "--json"],
                             env=env | {"AWS_ENDPOINT_URL": endpoint, "PREFECT_API_URL": prefect_api}, cwd=ROOT,
                             capture_output=True, text=True, timeout=900)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        assert json.loads(ran.stdout)["state"] == "Completed"
        code = _snippet().replace("http://127.0.0.1:5000", endpoint)
        looked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert looked.returncode == 0, looked.stderr
        assert "'embeddings/'" in looked.stdout and "'registry/'" in looked.stdout
        assert re.search(r"^quickstart-batch-train-\S+ \[\{", looked.stdout, re.MULTILINE), looked.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        rest, _ = server.communicate(timeout=60)
    assert server.returncode == 0, rest
    assert not work.exists() and f"removed {work}" in " ".join(rest.split())
