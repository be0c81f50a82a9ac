"""nccom-test's vocabulary: the collective operations it sweeps and the bus-bandwidth factor of each.

busbw = algbw x factor, where the factor is the share of the buffer each rank must send over the
ring: 2(r-1)/r for all-reduce (a reduce-scatter then an all-gather), (r-1)/r for all-gather,
reduce-scatter and all-to-all.
"""

from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""The operations a sweep covers. A sweep's rows, in nccom-test's columns, are
`trnflow.measures.SweepRow`."""


def bus_factor(op: str, ranks: int) -> float:
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return (ranks - 1) / ranks
