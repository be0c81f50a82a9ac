"""Collective plans over a job's NeuronCores: where each rank runs, and how the ring and tree forms of
all-reduce, all-gather and reduce-scatter move a buffer between the ranks, step by step.

A `Topology` places every global rank of a job on its (node, device, core). Ranks are numbered
node-major, as torchrun numbers them: rank = node x cores_per_node + local rank, and local rank i
runs on the node's core i (the first aligned range of cores, where a job runs when every core is
healthy).

A `CollectivePlan` describes an op by rule rather than by listing its transfers, so 2,048 ranks plan
as quickly as 8. It has an order of the ranks (positions 0..n-1) and phases, each a number of steps
and one rule saying which position sends which chunks to which at each step. The buffer is cut into
n chunks; chunk r is rank r's share, the part reduce-scatter leaves on rank r and all-gather takes
from it.

- ring: the ranks in an order that follows the hardware. On each node it goes through the devices
  along their links (the 4x4 torus of a 16-device instance, the ring of a smaller one), the cores of
  one device next to each other, then on to the next node, so that a pass round the ring crosses the
  network once per node. All-reduce is a reduce-scatter (n-1 steps: each position adds the chunk
  its predecessor passes on) then an all-gather (n-1 steps: each passes on the chunk it last
  completed); at every step each rank sends one chunk.
- tree: all-reduce reduces up a binomial tree (ceil(log2 n) steps, the whole buffer at each hop),
  then broadcasts the sum back down it (as many steps). All-gather is recursive doubling and
  reduce-scatter recursive halving, ceil(log2 n) steps each, in Bruck's form, which holds for any n:
  at each step a rank passes what it holds to the rank 2^k positions away.

The counts (`steps`, `crossing_steps`, `bytes_per_rank`, `bus_factor`) come from the rules without
listing transfers; `CollectivePlan.transfers(step)` spells one step out, to check a small plan
against its arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

from trnflow.measures import PlanSummary
from trnflow.neuron.launch import aligned_ranges
from trnflow.neuron.topology import torus_neighbours
from trnflow.specs import JobSpec, instance

OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
"""The ops a plan is made for (nccom-test's names)."""
ALGORITHMS: tuple[str, ...] = ("ring", "tree")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one rank runs."""

    node: int
    device: int
    """The Neuron device on its node (`neuron_device` in neuron-ls)."""
    core: int
    """The NeuronCore on its node, as `NEURON_RT_VISIBLE_CORES` counts them."""


@dataclass(frozen=True, slots=True)
class Topology:
    """A job's ranks on its nodes' NeuronCores."""

    instance_type: str
    nodes: int
    cores_per_node: int
    """NeuronCores used on each node, one rank each."""
    devices_per_node: int
    """Devices the instance has (some may hold no rank when the job uses fewer cores)."""
    cores_per_device: int
    placements: tuple[Placement, ...]
    """Each rank's placement, indexed by global rank."""
    ring_order: tuple[int, ...]
    """The ranks in ring order: on each node along the device links, then on to the next node."""

    @property
    def ranks(self) -> int:
        """The job's world size."""
        return len(self.placements)

    def node_of(self, rank: int) -> int:
        """The node `rank` runs on."""
        return rank // self.cores_per_node


@cache
def device_path(devices: int, used: int) -> tuple[int, ...]:
    """The order a ring visits devices 0..used-1 of a `devices`-device instance, moving only along the
    links `torus_neighbours` lists wherever such a path exists (else in the snake's order). On a whole
    trn1.32xlarge it is a snake over the 4x4 torus, 0 1 2 3 7 6 5 4 8 .. 15 14 13 12, and 12 links
    back to 0; on a ring of devices it is 0 1 2 ..."""
    side = 4 if devices == 16 else devices  # torus_neighbours' 4x4 torus, else one ring

    def snake(device: int) -> int:
        row, col = divmod(device, side)
        return row * side + (col if row % 2 == 0 else side - 1 - col)

    def colour(device: int) -> int:
        return sum(divmod(device, side)) % 2

    links = {d: sorted((n for n in torus_neighbours(d, devices) if n < used), key=snake) for d in range(used)}
    starts = sorted(range(used), key=snake)
    if devices == 16 and used % 2:
        # Each torus link joins the two colours of (row + col) % 2, so a path through an odd number of
        # devices starts (and ends) on the colour that has more of them: no other start need be tried.
        more = int(2 * sum(map(colour, starts)) > used)
        starts = [d for d in starts if colour(d) == more]

    def extend(path: list[int], seen: set[int]) -> bool:
        if len(path) == used:
            return True
        for nxt in links[path[-1]]:
            if nxt not in seen:
                path.append(nxt)
                seen.add(nxt)
                if extend(path, seen):
                    return True
                path.pop()
                seen.discard(nxt)
        return False

    for first in starts:
        path = [first]
        if extend(path, {first}):
            return tuple(path)
    return tuple(starts)


def build_topology(instance_type: str, nodes: int, cores_per_node: int) -> Topology:
    """The placement and ring order of `nodes` instances of `instance_type`, `cores_per_node` ranks each."""
    if nodes < 1 or cores_per_node < 1:
        raise ValueError(f"a topology needs a node and a core on each, not {nodes} node(s) of {cores_per_node}")
    t = instance(instance_type)
    cores = aligned_ranges(cores_per_node, t.cores)[0]
    local = [(core // t.cores_per_chip, core) for core in cores]
    placements = tuple(Placement(node, device, core) for node in range(nodes) for device, core in local)
    by_device: dict[int, list[int]] = {}
    for local_rank, (device, _) in enumerate(local):
        by_device.setdefault(device, []).append(local_rank)
    path = device_path(t.chips, max(by_device) + 1)
    node_ring = [local_rank for device in path for local_rank in by_device.get(device, [])]
    order = tuple(node * cores_per_node + local_rank for node in range(nodes) for local_rank in node_ring)
    return Topology(t.name, nodes, cores_per_node, t.chips, t.cores_per_chip, placements, order)


def job_topology(spec: JobSpec) -> Topology:
    """The topology of a job spec's compute section."""
    return build_topology(spec.compute.instance_type, spec.compute.nodes, spec.compute.cores_per_node)


def ceil_log2(n: int) -> int:
    """ceil(log2 n) for n >= 1, in integers: the depth of a binomial tree over n ranks."""
    return (n - 1).bit_length()


Send = tuple[int, int, tuple[int, ...]]
"""(from position, to position, the positions whose chunks go): one send of a step, in positions."""
RING_PHASES = ("reduce-scatter", "all-gather")
TREE_PHASES = ("reduce", "broadcast")
BRUCK_PHASES = ("recursive-halving", "recursive-doubling")


@dataclass(frozen=True, slots=True)
class Phase:
    """A run of steps under one rule, over positions 0..n-1 of a plan's order. Steps are counted
    within the phase."""

    name: str
    """What the phase does: reduce-scatter, all-gather (ring); reduce, broadcast (binomial tree);
    recursive-halving, recursive-doubling."""
    ranks: int
    reduce: bool
    """Receivers add what they get to their own chunks (else they keep it as it is)."""

    def __post_init__(self) -> None:
        if self.name not in (*RING_PHASES, *TREE_PHASES, *BRUCK_PHASES):
            raise ValueError(f"no phase {self.name!r}: {', '.join((*RING_PHASES, *TREE_PHASES, *BRUCK_PHASES))}")

    @property
    def steps(self) -> int:
        """How many steps the phase takes."""
        return max(0, self.ranks - 1) if self.name in RING_PHASES else ceil_log2(self.ranks)

    def span(self, step: int) -> int:
        """How many positions apart the partners of `step` are: 1 on the ring; 2^k at step k going
        out (reduce, recursive-doubling), the farthest first coming back (broadcast, recursive-halving)."""
        if self.name in RING_PHASES:
            return 1
        if self.name in ("reduce", "recursive-doubling"):
            return 1 << step
        return 1 << (ceil_log2(self.ranks) - 1 - step)

    def chunks(self, step: int) -> int:
        """The chunks each sending rank sends at `step`."""
        if self.name in RING_PHASES:
            return 1
        if self.name in TREE_PHASES:
            return self.ranks  # the whole buffer
        return min(self.span(step), self.ranks - self.span(step))

    @property
    def every_rank_sends(self) -> bool:
        """Whether every rank sends at every step (on the ring and in Bruck's form; on a tree, fewer do)."""
        return self.name not in TREE_PHASES

    def pairs(self, step: int) -> Iterator[tuple[int, int]]:
        """(from, to) positions of every send of `step`."""
        n, d = self.ranks, self.span(step)
        if self.name == "reduce":  # the odd multiples of d hand their sums down to p - d
            yield from ((p, p - d) for p in range(d, n, 2 * d))
        elif self.name == "broadcast":  # the multiples of 2d pass the sum on to p + d
            yield from ((p, p + d) for p in range(0, n - d, 2 * d))
        elif self.name == "recursive-doubling":  # every rank passes what it holds back to p - d
            yield from ((p, (p - d) % n) for p in range(n))
        else:  # ring phases, recursive-halving: every rank passes on to p + d
            yield from ((p, (p + d) % n) for p in range(n))

    def sends(self, step: int) -> Iterator[Send]:
        """Every send of `step`, with the positions whose chunks it carries."""
        n, d, count = self.ranks, self.span(step), self.chunks(step)
        whole = tuple(range(n)) if self.name in TREE_PHASES else ()
        for src, dst in self.pairs(step):
            if self.name == "reduce-scatter":  # position x's chunk starts at x + 1 and ends, summed, at x
                chunks: tuple[int, ...] = ((src - step - 1) % n,)
            elif self.name == "all-gather":  # each passes on the chunk it completed last
                chunks = ((src - step) % n,)
            elif self.name in TREE_PHASES:
                chunks = whole
            elif self.name == "recursive-doubling":  # src holds chunks src .. src+d-1 and the receiver lacks them
                chunks = tuple((src + j) % n for j in range(count))
            else:  # recursive-halving: src keeps chunks src .. src+d-1 and hands on the partial sums after them
                chunks = tuple((src + d + j) % n for j in range(count))
            yield src, dst, chunks

    def crossing_steps(self, node_at: tuple[int, ...]) -> int:
        """How many steps have a send between positions on different nodes (`node_at`: each position's node)."""

        def crosses(step: int) -> bool:
            return any(node_at[src] != node_at[dst] for src, dst in self.pairs(step))

        if self.name in RING_PHASES:  # every step sends along the same links
            return self.steps if self.steps and crosses(0) else 0
        return sum(crosses(step) for step in range(self.steps))


@dataclass(frozen=True, slots=True)
class Transfer:
    """One send of one step: `src` passes `chunks` (chunk r is rank r's share) to `dst`."""

    src: int
    dst: int
    chunks: tuple[int, ...]
    reduce: bool
    """`dst` adds them to its own (else it keeps them as they are)."""


@dataclass(frozen=True, slots=True)
class CollectivePlan:
    """One collective op over a topology, as rules: an order of the ranks and the phases that run on it."""

    op: str
    algorithm: str
    topology: Topology
    order: tuple[int, ...]
    """The rank at each position."""
    phases: tuple[Phase, ...]
    size: int
    """The whole buffer's bytes (what all-reduce reduces, all-gather gathers, reduce-scatter scatters)."""
    crossing_steps: int
    """Steps with a send from one node to another."""
    network_hops: int
    """Times the order crosses from one node to the next in one pass round it (wrapping)."""
    chunks_sent: int
    """The chunks the busiest rank sends over the whole op (every rank alike on the ring)."""

    @property
    def steps(self) -> int:
        """Every phase's steps together."""
        return sum(phase.steps for phase in self.phases)

    @property
    def chunk_bytes(self) -> int:
        """One chunk's bytes: the buffer cut in as many chunks as ranks (the last padded if need be)."""
        return -(-self.size // self.topology.ranks)

    @property
    def bytes_per_rank(self) -> int:
        """The bytes the busiest rank sends over the whole op (every rank alike on the ring)."""
        return self.chunks_sent * self.chunk_bytes

    @property
    def bus_factor(self) -> float:
        """The busiest rank's sent bytes over the buffer's: nccom-test's busbw / algbw for the ring."""
        return self.chunks_sent / self.topology.ranks

    def _phase_at(self, step: int) -> tuple[Phase, int]:
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} is not one of the plan's {self.steps}")
        for phase in self.phases:
            if step < phase.steps:
                return phase, step
            step -= phase.steps
        raise AssertionError("unreachable")

    def step_bytes(self, step: int) -> int:
        """The bytes each sending rank sends at `step` (0-based over the whole plan)."""
        phase, within = self._phase_at(step)
        return phase.chunks(within) * self.chunk_bytes

    def transfers(self, step: int) -> Iterator[Transfer]:
        """The sends of `step` (0-based over the whole plan), in ranks; they all happen at once."""
        phase, within = self._phase_at(step)
        order = self.order
        for src, dst, chunks in phase.sends(within):
            yield Transfer(order[src], order[dst], tuple(order[c] for c in chunks), phase.reduce)

    def summary(self) -> PlanSummary:
        """The plan's figures, without its rules."""
        return PlanSummary(op=self.op, algorithm=self.algorithm, ranks=self.topology.ranks, nodes=self.topology.nodes,
                           size=self.size, steps=self.steps, crossing_steps=self.crossing_steps,
                           network_hops=self.network_hops, bytes_per_rank=self.bytes_per_rank,
                           bus_factor=self.bus_factor)


_PHASES: dict[tuple[str, str], tuple[tuple[str, bool], ...]] = {
    ("all_reduce", "ring"): (("reduce-scatter", True), ("all-gather", False)),
    ("all_gather", "ring"): (("all-gather", False),),
    ("reduce_scatter", "ring"): (("reduce-scatter", True),),
    ("all_reduce", "tree"): (("reduce", True), ("broadcast", False)),
    ("all_gather", "tree"): (("recursive-doubling", False),),
    ("reduce_scatter", "tree"): (("recursive-halving", True),),
}


def build_plan(topology: Topology, op: str, algorithm: str, size: int) -> CollectivePlan:
    """The plan of `op` by `algorithm` over `topology`'s ranks in ring order, for a buffer of `size` bytes."""
    if (op, algorithm) not in _PHASES:
        raise ValueError(f"no {algorithm!r} plan for {op!r}: ops {', '.join(OPS)}; algorithms {', '.join(ALGORITHMS)}")
    if size < 0:
        raise ValueError(f"a buffer of {size} bytes")
    n, order = topology.ranks, topology.ring_order
    phases = tuple(Phase(name, n, reduce) for name, reduce in _PHASES[op, algorithm])
    node_at = tuple(topology.node_of(rank) for rank in order)
    crossing = sum(phase.crossing_steps(node_at) for phase in phases)
    hops = sum(node_at[p] != node_at[p - 1] for p in range(n))
    return CollectivePlan(op, algorithm, topology, order, phases, size, crossing, hops, _busiest(phases))


def _busiest(phases: tuple[Phase, ...]) -> int:
    """The most chunks one rank sends over `phases`. Where every rank sends at every step they all send
    alike; on a tree they differ (a leaf sends once, the root at every step of the broadcast), so a
    tree's sends are counted rank by rank."""
    alike, by_rank = 0, {}
    for phase in phases:
        if phase.every_rank_sends:
            alike += sum(phase.chunks(step) for step in range(phase.steps))
            continue
        for step in range(phase.steps):
            for src, _ in phase.pairs(step):
                by_rank[src] = by_rank.get(src, 0) + phase.chunks(step)
    return alike + max(by_rank.values(), default=0)


def summaries(topology: Topology, size: int, ops: tuple[str, ...] = OPS,
              algorithms: tuple[str, ...] = ALGORITHMS) -> list[PlanSummary]:
    """The summary of every op's plan by every algorithm over `topology`, for a buffer of `size` bytes."""
    return [build_plan(topology, op, algorithm, size).summary() for op in ops for algorithm in algorithms]
