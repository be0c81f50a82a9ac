"""nccom-test's vocabulary: the collective operations it sweeps and the bus-bandwidth factor of each.

busbw = algbw x factor, where the factor is the share of the buffer each rank must send over the
ring: 2(r-1)/r for all-reduce (a reduce-scatter then an all-gather), (r-1)/r for all-gather,
reduce-scatter and all-to-all.
"""

from __future__ import annotations

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
TIME = "time:avg(us)"
"""The time column of trnflow's sweep rows (the average of the timed iterations, in microseconds),
named as current nccom-test names it in its table and its JSON report, whether the rows come from
nccom-test or from trnflow's own sweep."""
OLD_TIME = "time(us)"
"""What older nccom-test versions, and trnflow's rows before them, called the same column."""
TIME_COLUMNS = (TIME, OLD_TIME)
"""nccom-test's time column, newest spelling first. trnflow's rows say TIME whichever the tool wrote."""


def time_columns(microseconds: float) -> dict[str, float]:
    """A sweep row's time, under the name nccom-test writes it (TIME)."""
    return {TIME: microseconds}


def row_time(row: dict) -> float | None:
    """A row's time under whichever name it has (TIME_COLUMNS; rows stored by an older trnflow say
    OLD_TIME), or None."""
    return next((float(row[c]) for c in TIME_COLUMNS if row.get(c) is not None), None)


def bus_factor(op: str, ranks: int) -> float:
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    return (ranks - 1) / ranks
