"""A local job is kept to itself: it listens on loopback only (torchrun's rendezvous store, gloo's
connections and anything else its processes open are reachable from this machine, never from the
network), and nothing in the folder it was submitted from is imported by it."""

import ipaddress
import json
import os
import time
from pathlib import Path

import pytest

from tests.process_tree import descendants
from trnflow.backends import JobRequest, JobState, forkserver, wait
from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings

LISTEN = "0A"


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # four little-endian words
    address = ipaddress.IPv6Address(words)
    return address.ipv4_mapped or address


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on, from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.append((str(_address(address)), int(port, 16)))
    return found


def test_a_running_local_job_listens_on_loopback_only(make_spec, trnflow_home):
    backend = LocalBackend(TrnflowSettings().jobs_dir)
    spec = make_spec(name="ports", train={"steps": 100_000, "checkpoint_every": 100_000})
    job = backend.submit(JobRequest(spec, "train", "ports", cores=(0, 1)))
    try:
        deadline = time.monotonic() + 120
        while '"event": "data"' not in backend.logs(job)[0] and time.monotonic() < deadline:
            time.sleep(0.2)  # both ranks have joined the process group and train
        assert '"event": "data"' in backend.logs(job)[0], backend.logs(job)[0][-2000:]
        supervisor = json.loads((TrnflowSettings().jobs_dir / job / "pid.json").read_text())["pid"]
        sockets = listening(descendants(supervisor) | {supervisor})
        assert sockets, "the job listens nowhere: its rendezvous store was not found"
        exposed = [(a, p) for a, p in sockets if not ipaddress.ip_address(a).is_loopback]
        assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"
    finally:
        backend.cancel(job)


@pytest.mark.parametrize("warm", [False, True], ids=["started", "forked"])
def test_a_job_imports_nothing_from_the_folder_it_was_submitted_from(warm, make_spec, trnflow_home, tmp_path,
                                                                    monkeypatch):
    """A module beside the spec, named as the recipe (with module recipes allowed) and found where the
    job is submitted, is not found by the job, whose processes start in the submitting folder: the
    job fails saying so, and the module never ran. Either way the backend starts a job: a supervisor
    started as a program, or forked from a fork server started in that folder."""
    submitting = tmp_path / "submitting"
    submitting.mkdir()
    marker = tmp_path / "ran.txt"
    (submitting / "beside_the_spec.py").write_text(
        "import os\nfrom trnflow.workload.recipes.m5_text import M5Text as Thing\n"
        f"if os.getpid() != {os.getpid()}:  # run anywhere but in the submitting process\n"
        f"    open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(submitting)
    monkeypatch.syspath_prepend(str(submitting))  # as `python -m` from there puts it: the submitter finds it
    monkeypatch.setenv("TRNFLOW_RECIPE_MODULES", "1")
    spec = make_spec(name="beside")
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"recipe": "beside_the_spec:Thing"})})
    monkeypatch.setattr(forkserver, "_SERVER", None)  # a fork server of its own, started from this folder
    backend = LocalBackend(TrnflowSettings().jobs_dir, warm_start=warm)
    try:
        info = wait(backend, backend.submit(JobRequest(spec, "train", "beside")), 0.2)
    finally:
        if forkserver._SERVER is not None:
            forkserver._SERVER.stop()
    assert info.state is JobState.FAILED
    assert "no module 'beside_the_spec' can be imported here" in info.failure.message, info.failure
    assert not marker.exists()
