"""The placement half of the device seam, on the emulator (whose torch device is the CPU): inputs
stay the same tensors, host copies are the tensors themselves, and state dicts keep their shape;
and the compile half a runtime device shares with the Neuron compiler: its cache."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import quickstart_data
from trnflow.cli.app import app
from trnflow.device.base import RecompileGuard
from trnflow.device.cache import CompileCache, entry_name
from trnflow.device.indexed import IndexedGraphs
from trnflow.device.registry import get_device
from trnflow.emulator.device import private_inductor_dir
from trnflow.errors import Recompilation
from trnflow.neuron.launch import PIN_CPUS_ENV, compiler_cache_dir, launch_env
from trnflow.specs import validate_spec


def test_on_the_cpu_nothing_is_copied_and_nests_keep_their_shape():
    device = get_device("emulator")
    assert device.torch_device == torch.device("cpu")
    t = torch.arange(4)
    assert device.put(t) is t
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    host = device.to_host(state)
    assert host["param_groups"] == state["param_groups"]
    assert isinstance(host["param_groups"][0]["betas"], tuple)
    assert all(host["state"][i][k] is state["state"][i][k] for i in state["state"] for k in state["state"][i])
    weights = device.to_host(model.state_dict())
    assert weights["weight"].data_ptr() == model.weight.data_ptr()


def test_evaluation_runs_without_autograd():
    with get_device("emulator").inference():
        assert not torch.is_grad_enabled()


def test_a_runtime_devices_graphs_are_filed_beside_the_neuron_compilers_own_entries(tmp_path):
    """The `xla` device points neuronx-cc's --cache_dir at the compile cache's root: the compiler's
    entries and trnflow's index of the runtime's graphs share it, and each reads as what it is."""

    class Journal(IndexedGraphs):
        def observe(self) -> None:
            return None

    url = tmp_path.as_uri()
    real = tmp_path / "neuronxcc-2.15.128.0+56dc5a86" / "MODULE_12486829708343293975+d41d8cd9"
    assert compiler_cache_dir(url) == str(tmp_path)  # where neuronx-cc writes its own entries
    real.mkdir(parents=True)
    for name, data in {"model.hlo_module.pb": b"hlo", "model.neff": b"NEFF", "model.done": b""}.items():
        (real / name).write_bytes(data)

    flags = {"backend": "xla", "runtime": "NEURON"}
    compiled = Journal(flags, mode="compile", workdir=tmp_path / "work")
    (tmp_path / "work").mkdir()
    compiled.file("1f2e3d4c", 0.5, lambda: b"serialized executable")
    key = compiled.seen[0].key
    CompileCache(url).commit(entry_name(key), compiled.seen[0].graph.canonical(), flags,
                             (tmp_path / "work" / "1f2e3d4c").read_bytes())

    run = Journal(flags, CompileCache(url), "run", RecompileGuard(0))
    run.file("1f2e3d4c", 0.5, lambda: b"")
    assert [s.outcome for s in run.seen] == ["hit"]
    with pytest.raises(Recompilation, match="it is not in the compile cache"):
        run.file("99aa", 0.5, lambda: b"")

    listed = json.loads(CliRunner().invoke(app, ["cache", "ls", str(tmp_path), "--json"]).stdout)
    assert {(e["compiler"], e["state"], e["origin"]) for e in listed} == {
        ("neuronxcc-2.15.128.0+56dc5a86", "done", "neuronx-cc"), (entry_name(key).split("/")[0], "done", "trnflow")}


def test_threads_per_core_sets_each_workers_threads_and_pins_it_to_cpus_of_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv("TRNFLOW_HOST_CPUS", raising=False)  # every CPU of the machine
    shared = launch_env(validate_spec(quickstart_data()), [0, 1], "trn1.2xlarge", base={PIN_CPUS_ENV: "1"})
    assert shared["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2)) and PIN_CPUS_ENV not in shared
    monkeypatch.setenv("TRNFLOW_HOST_CPUS", "12")  # the machine's share this process's jobs may use
    assert [launch_env(validate_spec(quickstart_data()), cores, "trn1.32xlarge", base={})["OMP_NUM_THREADS"]
            for cores in ([0], [0, 1], list(range(16)))] == ["12", "6", "1"]
    pinned = launch_env(validate_spec(quickstart_data(compute={"threads_per_core": 1})), [0, 1], "trn1.2xlarge",
                        base={})
    assert pinned["OMP_NUM_THREADS"] == "1" and pinned[PIN_CPUS_ENV] == "1"
    # In a process of its own, as a worker would: local rank r of a job whose first core is c takes
    # CPU slot (c + r) modulo the slots there are, so two one-core jobs on cores 0 and 1 do not share.
    probe = ("import json, os, sys; from trnflow.workload.tuning import pin_cpus; "
             "rank, workers, first = map(int, sys.argv[1:]); got = pin_cpus(rank, 1, workers, first); "
             "print(json.dumps([got, sorted(os.sched_getaffinity(0))]))")
    allowed = sorted(os.sched_getaffinity(0))

    def runs_on(rank: int, workers: int, first: int) -> list[int]:
        out = subprocess.run([sys.executable, "-c", probe, str(rank), str(workers), str(first)],
                             capture_output=True, text=True, check=True).stdout
        got, affinity = json.loads(out)
        assert got == affinity
        return got

    assert runs_on(len(allowed) - 1, len(allowed), 0) == [allowed[-1]]
    assert runs_on(0, 1, 1) == [allowed[1 % len(allowed)]]  # a one-core job on core 1: not the first CPU
    if len(allowed) >= 2:
        assert runs_on(1, 2, 2) == [allowed[3 % len(allowed)]]  # rank 1 of a job on cores 2 and 3
    assert runs_on(0, len(allowed) + 1, 0) == allowed  # more workers than CPUs: left to the scheduler


HEAP_PROBE = """
import ctypes, resource, sys
from trnflow.workload.tuning import steady_heap
if sys.argv[1] == "steady":
    assert steady_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 4 << 20

def batch():  # a forward pass's activations: a few blocks of a few MiB, written, then all freed
    blocks = [libc.malloc(size) for _ in range(5)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)

batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    batch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _has_mallopt() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


@pytest.mark.skipif(not _has_mallopt(), reason="the C library has no mallopt (not glibc): steady_heap does nothing")
def test_a_steady_heap_keeps_each_batchs_memory_instead_of_faulting_it_in_again():
    """A worker's heap keeps the blocks a batch frees (`steady_heap`, called by every worker): with
    glibc's starting thresholds the heap is trimmed after each batch and every page of the next
    batch's blocks is a page fault again."""
    faults = {mode: int(subprocess.run([sys.executable, "-c", HEAP_PROBE, mode], capture_output=True, text=True,
                                       check=True).stdout) for mode in ("default", "steady")}
    pages = 20 * 5 * (4 << 20) // os.sysconf("SC_PAGE_SIZE")  # what faulting every page in again would take
    assert faults["default"] > pages // 2
    assert faults["steady"] < pages // 50


@pytest.mark.parametrize("optlevel", [1, 2, 3])
def test_every_module_the_compile_pool_preloads_exists(optlevel):
    """The compile pool's server imports these before forking workers, and skips a name it cannot
    import without a word: a misspelt one would only make every worker import it again."""
    import importlib.util

    spec = validate_spec(quickstart_data(compile={"optlevel": optlevel}))
    names = get_device("emulator").compile_imports(spec)
    assert "torch._dynamo" in names
    assert [n for n in names if importlib.util.find_spec(n) is None] == []


def test_a_killed_ranks_inductor_folder_is_removed_by_the_next_rank(tmp_path):
    # A rank that made its folder, then was killed by a signal: its exit handler never ran.
    with subprocess.Popen([sys.executable, "-c", "import time; from trnflow.emulator.device import "
                           f"private_inductor_dir; print(private_inductor_dir({str(tmp_path)!r}), flush=True); "
                           "time.sleep(120)"], stdout=subprocess.PIPE, text=True) as rank:
        assert rank.stdout is not None
        killed = Path(rank.stdout.readline().strip())
        (killed / "graph.py").write_text("compiled\n")
        rank.kill()
    assert killed.is_dir() and killed.name.startswith(f"trnflow-inductor-{rank.pid}-")
    running = tmp_path / f"trnflow-inductor-{os.getpid()}-live"  # a rank still running keeps its folder
    unnamed = tmp_path / "trnflow-inductor-k3x9q2"  # one made before folders were named by process
    running.mkdir()
    unnamed.mkdir()

    mine = private_inductor_dir(tmp_path)

    assert not killed.exists()
    assert running.is_dir() and unnamed.is_dir() and mine.is_dir()
    assert mine.name.startswith(f"trnflow-inductor-{os.getpid()}-")
