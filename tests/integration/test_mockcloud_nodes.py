"""A killed instance of the mocked cloud leaves nothing behind, not even processes that started a
session of their own (as torchrun's workers do)."""

import os
import sys
import time

from trnflow.testing.mockcloud import nodes

LEAVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_killing_a_node_ends_the_processes_that_left_its_process_group(tmp_path, monkeypatch):
    monkeypatch.setattr(nodes, "ENTRYPOINT", [sys.executable, "-c", LEAVER])
    node = nodes.Node(args=[], env=dict(os.environ), log=tmp_path / "node.log", stream="s")
    node.start()
    deadline = time.monotonic() + 30
    while not node.log.read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(node.log.read_text().split()[0])
    assert os.getpgid(child) != node.proc.pid  # out of the container's group: killpg cannot reach it
    assert child in nodes.marked_processes(node.mark)

    node.kill()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert nodes.marked_processes(node.mark) == []
