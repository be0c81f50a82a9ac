"""A killed instance of the mocked cloud leaves nothing behind, not even processes that started a
session of their own (as torchrun's workers do), whether its container started cold or was forked
from the warm start server; and a warm container runs as a cold one does."""

import os
import sys
import time

import pytest

from trnflow.testing.mockcloud import nodes

LEAVER = """
import os, subprocess, sys, time
started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
forked = os.fork()
if forked == 0:  # as the launcher forks its ranks, each in a session of its own
    os.setsid()
    time.sleep(120)
    os._exit(0)
while os.getpgid(forked) != forked:  # said once the child is in its own session, as the launcher's ranks are
    time.sleep(0.01)
print(started.pid, forked, os.environ["TRNFLOW_MOCK_NODE"], sys.argv[1:], flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _image_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in nodes.PASSED_THROUGH}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_killing_a_node_ends_the_processes_that_left_its_process_group(tmp_path, monkeypatch, warm):
    monkeypatch.setattr(nodes, "ENTRYPOINT", [sys.executable, "-c", LEAVER])
    node = nodes.Node(args=["an-argument"], env=_image_env(), log=tmp_path / "node.log", stream="s")
    node.start(warm=warm)
    deadline = time.monotonic() + 60
    while not (node.log.is_file() and node.log.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    started, forked, mark, args = node.log.read_text().split(maxsplit=3)
    assert mark == node.mark and args.strip() == "['an-argument']"  # its environment and arguments
    children = [int(started), int(forked)]
    assert all(os.getpgid(child) != node.proc.pid for child in children)  # out of reach of killpg
    assert set(children) | {node.proc.pid} <= set(nodes.marked_processes(node.mark))

    node.kill()
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, children))
    assert nodes.marked_processes(node.mark) == []
    assert node.proc.returncode == -9


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_container_exits_and_says_why_as_the_image_runs_it(tmp_path, warm):
    """The image's entrypoint with an argument it does not know: its usage in the node's log, and
    its exit code."""
    node = nodes.Node(args=["neither-train-nor-batch"], env=_image_env(), log=tmp_path / "node.log", stream="s")
    node.start(warm=warm)
    assert node.proc.wait(60) == 2
    assert node.log.read_text() == ("usage: python -m trnflow.backends.container train|batch  "
                                    "(SageMaker runs the image with `train`)\n")


def test_a_warm_container_killed_as_soon_as_it_started_is_gone(tmp_path, monkeypatch):
    """The server answers once the container is in its own session with its node's mark, so a kill
    straight after the start reaches it whole."""
    monkeypatch.setattr(nodes, "ENTRYPOINT", [sys.executable, "-c", LEAVER])
    node = nodes.Node(args=[], env=_image_env(), log=tmp_path / "node.log", stream="s")
    node.start(warm=True)
    assert os.getpgid(node.proc.pid) == node.proc.pid
    node.kill()
    assert node.proc.returncode == -9 and nodes.marked_processes(node.mark) == []


def test_a_node_whose_python_finds_other_modules_starts_cold(tmp_path):
    """Another PYTHONPATH than the warm start server's (a test's own `sitecustomize`, say) is only
    honoured by a new interpreter."""
    env = {**_image_env(), "PYTHONPATH": str(tmp_path)}
    (tmp_path / "sitecustomize.py").write_text("import sys; print('customized', file=sys.stderr)\n")
    node = nodes.Node(args=["neither-train-nor-batch"], env=env, log=tmp_path / "node.log", stream="s")
    node.start(warm=True)
    assert node.proc.wait(60) == 2
    assert node.log.read_text().startswith("customized\nusage: ")
