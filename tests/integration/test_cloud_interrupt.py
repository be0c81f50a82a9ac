"""Issue 44, item 7: `trnflow run` stopped by SIGTERM during a cloud stage stops within seconds,
naming its run and the command that resumes it, even when the AWS endpoint no longer answers (the
job is cancelled if the service answers in time; otherwise the message says the job may still run)."""

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.test_mock_aws_docs import ROOT, SHORTER, TRNFLOW, _clean_env, _port, _started
from tests.process_tree import descendants
from trnflow.testing.mockcloud.nodes import NODE_MARK, marked_processes
from trnflow.testing.mockcloud.warm import PLACEHOLDER

STOP_SECONDS = 45
"""How long the run may take to end after SIGTERM (before the fix: minutes, retrying the dead endpoint)."""


def _wait_for(path: Path, text: str, proc: subprocess.Popen, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while text not in path.read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, path.read_text(errors="replace")[-3000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_a_run_stops_within_seconds_of_sigterm_during_a_cloud_stage_when_the_endpoint_no_longer_answers(
        tmp_path, prefect_api):
    port = _port()
    env = _clean_env(tmp_path)
    server = subprocess.Popen([str(TRNFLOW), "mock-aws", "--port", str(port)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, err = tmp_path / "run.out", tmp_path / "run.err"
    try:
        _started(server)
        with open(out, "w") as stdout, open(err, "w") as stderr:
            run = subprocess.Popen([str(TRNFLOW), "run", "jobspecs/examples/quickstart-batch.yaml", *SHORTER,
                                    "--run-id", "stopped-in-the-cloud"],
                                   env=env | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
                                              "PREFECT_API_URL": prefect_api, "PREFECT_LOGGING_LEVEL": "INFO"},
                                   cwd=ROOT, stdout=stdout, stderr=stderr, text=True)
        _wait_for(err, "submitted to the batch backend", run)
        os.kill(server.pid, signal.SIGSTOP)  # the endpoint accepts connections and never answers
        time.sleep(2)
        run.send_signal(signal.SIGTERM)
        began = time.monotonic()
        try:
            run.wait(timeout=STOP_SECONDS)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
        stopped_after = time.monotonic() - began
        printed = " ".join(err.read_text().split())
        assert run.returncode == 130, (stopped_after, printed[-3000:])
        assert "interrupted: run stopped-in-the-cloud stopped" in printed
        assert "trnflow run jobspecs/examples/quickstart-batch.yaml --set" in printed
        assert "--run-id stopped-in-the-cloud" in printed
        assert "may still be running: stop it with `aws batch terminate-job --job-id " in printed  # no answer in time
    finally:  # the frozen endpoint is not stopped gracefully: it and its jobs' containers are killed
        marks = _node_marks(server.pid)
        server.kill()
        server.communicate()
        for mark in marks:
            for pid in marked_processes(mark):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def _node_marks(ancestor: int) -> set[str]:
    """The marks of the mock cloud containers `ancestor` started, cold or through its warm start
    server (each node's processes carry its mark)."""
    marks = set()
    for pid in descendants(ancestor):
        try:
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
        except OSError:
            continue
        if NODE_MARK in env and env[NODE_MARK] != PLACEHOLDER:  # the warm start server's own
            marks.add(env[NODE_MARK])
    return marks
