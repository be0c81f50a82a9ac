"""A job of 64 trn1.32xlarge nodes (2,048 NeuronCores): its SageMaker and Batch requests, where its
ranks run, and the ring and tree collective plans over them. The plans' step counts are checked
against the algorithms' formulas, and small plans are carried out on lists to show that their step
rules really leave every rank with the sum."""

from __future__ import annotations

import math

import pytest

from tests.unit.test_cloud_requests import TARGET, _spec
from trnflow.backends import JobRequest
from trnflow.backends.batch_request import build_job_definition, build_submit_job
from trnflow.backends.sagemaker_request import build_training_job_request
from trnflow.neuron.nccom import bus_factor
from trnflow.neuron.plan import CollectivePlan, build_plan, build_topology, job_topology
from trnflow.neuron.topology import torus_neighbours

NODES, CORES = 64, 32
SIZE = 64 * 1024 * 1024  # a 64 MiB buffer: 32 KiB a rank on 2,048 ranks


@pytest.fixture(scope="module")
def big_spec():
    return _spec(itype="trn1.32xlarge", nodes=NODES, cores=CORES)


def test_the_sagemaker_and_batch_requests_ask_for_64_nodes_of_32_cores(big_spec):
    request = JobRequest(big_spec, "train", "r64")
    sagemaker = build_training_job_request(request, TARGET)
    assert sagemaker["ResourceConfig"]["InstanceType"] == "ml.trn1.32xlarge"
    assert sagemaker["ResourceConfig"]["InstanceCount"] == 64
    assert sagemaker["Environment"]["TRNFLOW_NPROC_PER_NODE"] == "32"

    definition = build_job_definition(big_spec, TARGET)
    nodes = definition["nodeProperties"]
    assert (nodes["numNodes"], nodes["mainNode"]) == (64, 0)
    assert [r["targetNodes"] for r in nodes["nodeRangeProperties"]] == ["0:"]  # one range: nodes 0 to 63 alike
    container = nodes["nodeRangeProperties"][0]["container"]
    assert container["instanceType"] == "trn1.32xlarge"
    devices = [d["hostPath"] for d in container["linuxParameters"]["devices"]]
    assert [d for d in devices if d.startswith("/dev/neuron")] == [f"/dev/neuron{i}" for i in range(16)]

    submit = build_submit_job(request, TARGET, definition["jobDefinitionName"])
    overrides = submit["nodeOverrides"]
    assert overrides["numNodes"] == 64
    (every_node,) = overrides["nodePropertyOverrides"]
    assert every_node["targetNodes"] == "0:"
    env = {e["name"]: e["value"] for e in every_node["containerOverrides"]["environment"]}
    assert env["TRNFLOW_NPROC_PER_NODE"] == "32" and env["TRNFLOW_PHASE"] == "train"


def test_2048_ranks_sit_node_major_on_distinct_cores_of_16_devices_a_node(big_spec):
    topology = job_topology(big_spec)
    assert topology.ranks == NODES * CORES == 2048
    placements = [(p.node, p.device, p.core) for p in topology.placements]
    assert len(set(placements)) == 2048
    for rank in (0, 1, 31, 32, 33, 1000, 2047):  # torchrun: rank = node_rank x nproc_per_node + local_rank
        node, local = divmod(rank, CORES)
        assert placements[rank] == (node, local // 2, local)  # local rank i on core i; 2 cores a device
    devices: dict[int, set[int]] = {}
    for node, device, _ in placements:
        devices.setdefault(node, set()).add(device)
    assert sorted(devices) == list(range(64)) and all(used == set(range(16)) for used in devices.values())


def test_the_ring_follows_the_device_links_on_each_node_and_crosses_the_network_once_per_node(big_spec):
    topology = job_topology(big_spec)
    ring = topology.ring_order
    assert sorted(ring) == list(range(2048))
    where = [topology.placements[rank] for rank in ring]
    hops = list(zip(where, where[1:] + where[:1], strict=True))  # round the ring, the last back to the first
    crossings = [(a, b) for a, b in hops if a.node != b.node]
    assert len(crossings) == 64
    assert all(b.node == (a.node + 1) % 64 for a, b in crossings)  # node to next node, the last back to 0
    for a, b in hops:
        if a.node == b.node and a.device != b.device:
            assert b.device in torus_neighbours(a.device, 16), (a, b)
    device_changes = sum((a.node, a.device) != (b.node, b.device) for a, b in hops)
    assert device_changes == 64 * 16  # a device's two cores are next to each other: each device entered once
    assert build_plan(topology, "all_reduce", "ring", SIZE).network_hops == 64

    one = build_topology("trn1.32xlarge", 1, 32)  # on one node the ring closes over a torus link too
    first, last = (one.placements[one.ring_order[i]] for i in (0, -1))
    assert first.device in torus_neighbours(last.device, 16)
    assert build_plan(one, "all_reduce", "ring", SIZE).network_hops == 0


@pytest.mark.parametrize(("nodes", "cores"), [(64, 32), (4, 32), (2, 12), (5, 1), (1, 3), (1, 2), (1, 1)])
def test_step_counts_bytes_and_bus_factor_follow_the_ring_and_tree_formulas(nodes, cores):
    topology = build_topology("trn1.32xlarge", nodes, cores)
    n = nodes * cores
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    size = n * 4096
    steps = {("all_reduce", "ring"): 2 * (n - 1), ("all_gather", "ring"): n - 1, ("reduce_scatter", "ring"): n - 1,
             ("all_reduce", "tree"): 2 * depth, ("all_gather", "tree"): depth, ("reduce_scatter", "tree"): depth}
    for (op, algorithm), expected in steps.items():
        assert build_plan(topology, op, algorithm, size).steps == expected, (op, algorithm)
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        ring = build_plan(topology, op, "ring", size)
        sends = 2 * (n - 1) if op == "all_reduce" else n - 1  # one chunk of size / n at every step
        assert ring.bytes_per_rank == sends * size // n
        assert all(ring.step_bytes(step) == size // n for step in range(ring.steps))
        assert ring.bus_factor == bus_factor(op, n)
    tree = build_plan(topology, "all_reduce", "tree", size)
    assert tree.bytes_per_rank == depth * size  # the root sends the whole buffer at every step down


def test_on_64_nodes_every_ring_step_crosses_nodes_and_the_tree_only_its_upper_levels(big_spec):
    topology = job_topology(big_spec)
    n = NODES * CORES
    ring = build_plan(topology, "all_reduce", "ring", SIZE)
    assert ring.crossing_steps == 2 * (n - 1)
    # the tree pairs ranks 1, 2, 4 .. 1024 positions apart; pairs fewer than 32 apart share a node
    depth, on_node = math.ceil(math.log2(n)), int(math.log2(CORES))
    assert build_plan(topology, "all_reduce", "tree", SIZE).crossing_steps == 2 * (depth - on_node)
    assert build_plan(topology, "all_gather", "ring", SIZE).crossing_steps == n - 1
    summary = ring.summary()
    assert (summary.op, summary.algorithm, summary.ranks, summary.nodes) == ("all_reduce", "ring", 2048, 64)
    assert (summary.steps, summary.crossing_steps, summary.network_hops) == (4094, 4094, 64)
    assert summary.line().startswith("all_reduce ring on 2048 ranks (64 node(s)): 4094 steps, 4094 crossing nodes")


def _carry_out(plan: CollectivePlan, state: list[list[int | None]]) -> list[int]:
    """Run `plan` on `state` (each rank's n chunk values; None where a rank holds nothing yet), each
    step's sends taken from what the ranks held before it. Returns the chunks each rank sent."""
    sent_by_rank = [0] * len(state)
    for step in range(plan.steps):
        transfers = list(plan.transfers(step))
        assert len({t.src for t in transfers}) == len(transfers), f"step {step}: a rank sends twice"
        assert len({t.dst for t in transfers}) == len(transfers), f"step {step}: a rank receives twice"
        payloads = [[state[t.src][c] for c in t.chunks] for t in transfers]
        for t, values in zip(transfers, payloads, strict=True):
            sent_by_rank[t.src] += len(t.chunks)
            for chunk, value in zip(t.chunks, values, strict=True):
                assert value is not None, f"step {step}: rank {t.src} sends chunk {chunk} it does not hold"
                held = state[t.dst][chunk]
                if t.reduce:
                    assert held is not None, f"step {step}: rank {t.dst} adds to chunk {chunk} it does not hold"
                    state[t.dst][chunk] = held + value
                else:
                    state[t.dst][chunk] = value
    return sent_by_rank


def _inputs(n: int) -> list[list[int]]:
    """Each rank's own vector of n chunks, different at every rank and position."""
    return [[(rank + 1) * 1000 + chunk * chunk + 7 * rank * chunk for chunk in range(n)] for rank in range(n)]


SMALL = [(1, 2), (1, 3), (1, 4), (5, 1), (1, 8), (1, 12), (2, 12), (2, 32)]
"""(nodes, cores per node): 2, 3, 4, 5, 8 ranks, and 12, 24 and 64, whose rings are not in rank order."""


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize(("nodes", "cores"), SMALL)
def test_all_reduce_plans_leave_every_rank_with_the_elementwise_sum(nodes, cores, algorithm):
    topology = build_topology("trn1.32xlarge", nodes, cores)
    n = topology.ranks
    inputs = _inputs(n)
    total = [sum(vector[chunk] for vector in inputs) for chunk in range(n)]
    plan = build_plan(topology, "all_reduce", algorithm, n * 8)
    state: list[list[int | None]] = [list(vector) for vector in inputs]
    sent = _carry_out(plan, state)
    assert all(vector == total for vector in state)
    assert max(sent) * plan.chunk_bytes == plan.bytes_per_rank


@pytest.mark.parametrize("algorithm", ["ring", "tree"])
@pytest.mark.parametrize(("nodes", "cores"), SMALL)
def test_reduce_scatter_and_all_gather_plans_leave_each_rank_its_share_and_every_share(nodes, cores, algorithm):
    topology = build_topology("trn1.32xlarge", nodes, cores)
    n = topology.ranks
    inputs = _inputs(n)
    total = [sum(vector[chunk] for vector in inputs) for chunk in range(n)]

    scatter = build_plan(topology, "reduce_scatter", algorithm, n * 8)
    state: list[list[int | None]] = [list(vector) for vector in inputs]
    sent = _carry_out(scatter, state)
    assert [state[rank][rank] for rank in range(n)] == total  # rank r holds the sum of chunk r
    assert max(sent) * scatter.chunk_bytes == scatter.bytes_per_rank

    gather = build_plan(topology, "all_gather", algorithm, n * 8)
    own = [inputs[rank][rank] for rank in range(n)]
    state = [[own[rank] if chunk == rank else None for chunk in range(n)] for rank in range(n)]
    sent = _carry_out(gather, state)
    assert all(vector == own for vector in state)
    assert max(sent) * gather.chunk_bytes == gather.bytes_per_rank
