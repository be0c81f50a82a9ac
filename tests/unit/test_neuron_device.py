"""The `neuron` device's logic, without a Neuron host: a stand-in `torch_neuronx` registers what the
real one does (the `neuron` PrivateUse1 name, a `neuron` torch.compile backend, the dynamo metrics
helper API), and its backend runs graphs eagerly on the CPU, listing one metrics entry per compiled
graph as torch-neuronx does. What runs on a real trn2 host is in docs/devices.md."""

from __future__ import annotations

import hashlib
import io
import json
import operator
import os
import socket
import sys
import tarfile
import types
import typing
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import quickstart_data
from trnflow.device.cache import CompileCache, entry_name
from trnflow.errors import Recompilation
from trnflow.specs import validate_spec

pytestmark = pytest.mark.unit


class FakeNeuronBackend:
    """What the device reads of torch-neuronx: compiled graphs listed in its dynamo metrics."""

    def __init__(self) -> None:
        self.metrics: list[types.SimpleNamespace] = []
        self.names: list[str] = []

    def compile(self, gm: torch.fx.GraphModule, example_inputs: list):
        shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
        graph_id = hashlib.sha256(f"{gm.code}{shapes}".encode()).hexdigest()[:16]
        self.metrics.append(types.SimpleNamespace(
            graph_id=graph_id, graph_name=f"{self.names[-1] if self.names else 'model'}_{len(self.metrics)}",
            model_name=self.names[-1] if self.names else "", has_collectives=False,
            graph_node_count=len(gm.graph.nodes), timestamp=0.0, torch_neuronx_fx_passes_us=1,
            torch_neuronx_lower_us=1, torch_neuronx_compile_us=2500))
        return gm.forward


def stand_in(backend: FakeNeuronBackend, setitem: Callable, setattr_: Callable) -> None:
    """What importing torch-neuronx does that the device relies on, through `setitem` and `setattr_`
    (a test's monkeypatch, so that it is undone; plain ones in a process of its own)."""
    module = types.ModuleType("torch_neuronx")
    module.__version__ = "2.14.3.0"
    helpers = types.ModuleType("torch_neuronx.neuron_dynamo_backend")
    helpers.get_dynamo_metrics = lambda: list(backend.metrics)
    helpers.set_model_name = backend.names.append
    module.neuron_dynamo_backend = helpers
    setitem(sys.modules, "torch_neuronx", module)
    setitem(sys.modules, "torch_neuronx.neuron_dynamo_backend", helpers)
    if torch._C._get_privateuse1_backend_name() != "neuron":  # once a process, as torch-neuronx does
        torch.utils.rename_privateuse1_backend("neuron")
        # and for good: with the name taken, torch looks up `torch.neuron` whenever it asks for the
        # accelerator (TorchDynamo does, on every frame it compiles), in later tests too
        torch.neuron = types.SimpleNamespace(device_count=lambda: 0, is_available=lambda: False)
    setattr_(torch, "neuron", types.SimpleNamespace(device_count=lambda: 2, is_available=lambda: False))
    from torch._dynamo.backends import registry  # torch-neuronx registers its backend the same way

    setitem(registry._BACKENDS, "neuron", None)
    setitem(registry._COMPILER_FNS, "neuron", backend.compile)


@pytest.fixture
def fake(monkeypatch):
    backend = FakeNeuronBackend()
    stand_in(backend, monkeypatch.setitem, lambda o, name, v: monkeypatch.setattr(o, name, v, raising=False))
    monkeypatch.delitem(sys.modules, "trnflow.device.neuron", raising=False)
    for name in ("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "TORCH_NEURONX_NEFF_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so that what the device sets is undone after the test
        monkeypatch.delenv(name)
    torch._dynamo.reset()
    from trnflow.device.neuron import NeuronDevice

    yield NeuronDevice(), backend
    torch._dynamo.reset()


def _spec(tmp_path: Path, **compile_section):
    return validate_spec(quickstart_data(compute={"device": "neuron", "instance_type": "trn2.48xlarge"},
                                         compile={"cache_url": str(tmp_path / "cache"), **compile_section}))


def test_the_device_is_the_neuron_privateuse1_device_joined_by_the_neuron_backend(fake, monkeypatch):
    device, _ = fake
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device.torch_device == torch.device("neuron", 1)
    monkeypatch.setenv("LOCAL_RANK", "5")  # a process that sees only its own cores: its first one
    assert device.torch_device == torch.device("neuron", 0)
    assert (device.process_group_backend, device.init_method) == ("neuron", "env://")
    assert device.process_group_backends() == "cpu:gloo,neuron:neuron"


def _rank(rank: int, port: int, out: Path) -> None:
    """One rank of a two-rank group on the stand-in: the `neuron` process-group backend is gloo
    under another name, as far as host tensors can tell (there are no Neuron tensors here)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    # the C++ side of a PrivateUse1 device (hooks, device guard) that torch-neuronx registers
    torch.utils.backend_registration._setup_privateuseone_for_python_backend("neuron")
    stand_in(FakeNeuronBackend(), operator.setitem, setattr)
    created = []

    def neuron_backend(store, group_rank, size, timeout):
        created.append(size)
        return dist.ProcessGroupGloo(store, group_rank, size, timeout)

    dist.Backend.register_backend("neuron", neuron_backend, devices=["neuron"])
    from trnflow.device.neuron import NeuronDevice
    from trnflow.workload.context import WorkerContext, gather_objects

    # what torch-neuronx's `torch.neuron` module also answers, which a device mesh asks
    torch.neuron = types.SimpleNamespace(device_count=lambda: 2, is_available=lambda: True,
                                         is_initialized=lambda: True, set_device=lambda index: None,
                                         current_device=lambda: rank)
    device = NeuronDevice()
    device.init_process_group(2, 60)
    mesh = device.mesh()  # what FSDP2 shards over under `train.parallelism.strategy: fsdp`
    seen_mesh = {"type": mesh.device_type, "size": mesh.size(), "world": mesh.get_group() == dist.group.WORLD,
                 "backend": str(dist.get_backend(mesh.get_group()))}
    logits = torch.zeros(4, dtype=torch.float64)  # as the evaluation fills its rows: each rank its own
    logits[rank::2] = rank + 1.0
    dist.all_reduce(logits)
    ctx = types.SimpleNamespace(world_size=2)
    everyone = gather_objects(typing.cast(WorkerContext, ctx), {"rank": rank})
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps({"logits": logits.tolist(), "gathered": everyone,
                                                      "neuron_backend_sizes": created, "mesh": seen_mesh}))
    dist.destroy_process_group()


@pytest.mark.slow  # two real processes: `make test` runs it, `make test-fast` leaves it out
def test_ranks_join_one_group_whose_host_tensors_go_to_gloo_and_device_tensors_to_neuron(tmp_path):
    """`cpu:gloo,neuron:neuron` across two real processes: the Neuron backend is created for the
    group, the host-tensor collectives the workload makes (the evaluation's all-reduce, object
    gathers, barriers) go through gloo, and sharded training's device mesh is that group on `neuron`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(port, tmp_path), nprocs=2, join=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["logits"] == [1.0, 2.0, 1.0, 2.0]
        assert seen["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert seen["neuron_backend_sizes"] == [2]
        # sharded training's mesh is the job's group on the `neuron` device, so FSDP2's gathers and
        # reduce-scatters of device tensors go to the Neuron backend (placing the shards on real
        # NeuronCores needs a Neuron host: the stand-in has no device memory)
        assert seen["mesh"] == {"type": "neuron", "size": 2, "world": True, "backend": "cpu:gloo,neuron:neuron"}


def test_the_compiler_sets_the_native_cache_and_refuses_eager_fallback(fake, tmp_path, monkeypatch):
    device, _ = fake
    spec = _spec(tmp_path)
    backend = device.compiler(spec, model="m5-text@1")
    assert backend.flags == {"backend": "neuron", "torch_neuronx": "2.14.3.0", "precision": "fp32",
                             "model": "m5-text@1"}
    assert os.environ["TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"] == "1"
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "cache" / "neff")
    device.compiler(_spec(tmp_path / "other"))  # another spec's cache: nothing carries over
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == str(tmp_path / "other" / "cache" / "neff")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", "/shared/neff")  # the user's own choice stays
    type(device)().compiler(spec)
    assert os.environ["TORCH_NEURONX_NEFF_CACHE_DIR"] == "/shared/neff"


def test_graphs_are_named_filed_and_a_new_shape_trips_the_guard(fake, tmp_path):
    device, neuron = fake
    spec = _spec(tmp_path, max_recompiles=0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())

    extract = device.compiler(spec, mode="extract")
    compiled = device.compile(model, extract)
    with extract.naming("eval_step", torch.zeros(4, 8)):
        compiled(torch.zeros(4, 8))
    (planned,) = extract.seen
    assert planned.program == "eval_step" and planned.graph.data_shapes == "[4, 8] float32"
    assert neuron.names == ["eval_step"]  # the backend names its artifacts after the program
    assert planned.key.startswith(f"MODULE_{neuron.metrics[0].graph_id}+")

    torch._dynamo.reset()
    workdir = tmp_path / "work"
    workdir.mkdir()
    compiling = device.compiler(spec, mode="compile", workdir=workdir)  # what an ahead-of-time compile job does
    compiled = device.compile(model, compiling)
    with compiling.naming("eval_step", torch.zeros(4, 8)):
        compiled(torch.zeros(4, 8))
    (built,) = compiling.seen
    assert (built.key, built.outcome) == (planned.key, "compiled")
    artifact = device.artifact(workdir)
    with tarfile.open(fileobj=io.BytesIO(artifact)) as packed:
        record = json.loads(packed.extractfile(neuron.metrics[1].graph_id).read())
    assert record["graph_id"] == neuron.metrics[1].graph_id and record["compile_us"] == 2500
    cache = CompileCache(str(tmp_path / "cache"))
    cache.commit(entry_name(planned.key), planned.graph.canonical(), extract.flags, artifact)
    torch._dynamo.reset()
    run = device.compiler(spec, log=lambda event, **fields: None)
    compiled = device.compile(model, run)
    with run.naming("eval_step", torch.zeros(4, 8)):
        compiled(torch.zeros(4, 8))
    assert run.metrics().hits == 1 and run.metrics().recompiles == []
    with pytest.raises(Recompilation) as stopped, run.naming("eval_step", torch.zeros(3, 8)):
        compiled(torch.zeros(3, 8))
    assert "[3, 8] float32" in str(stopped.value) and "compile.max_recompiles (0)" in str(stopped.value)
