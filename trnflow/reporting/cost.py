"""What a run costs: each job's billable time times its instances' hourly price.

Prices come from the instance catalogue (on-demand, us-east-1) unless the spec sets
`compute.price_per_hour`. For the local emulator, the billable time is the job's wall time: what
the same job would have cost on the instances the spec names. A job that failed and was submitted
again costs its time too.
"""

from __future__ import annotations

from trnflow.results import CostRow
from trnflow.specs import JobSpec, instance


def price_per_hour(spec: JobSpec) -> float | None:
    if spec.compute.price_per_hour is not None:
        return spec.compute.price_per_hour
    return instance(spec.compute.instance_type).price_per_hour


def job_cost(spec: JobSpec, stage: str, billable_seconds: float, jobs: int = 1) -> CostRow:
    """One row of the cost table, in the shape of the usual price-performance tables: a stage's
    `jobs` (its failed attempts included) and their billable time together."""
    price = price_per_hour(spec)
    nodes = spec.compute.nodes
    return CostRow(stage=stage, instance_type=spec.compute.instance_type, nodes=nodes, jobs=jobs,
                   price_per_node_hour=price, billable_seconds=round(billable_seconds, 1),
                   cost_usd=None if price is None else round(price * nodes * billable_seconds / 3600, 4))


def total(rows: list[CostRow]) -> float | None:
    """The run's cost; None when any instance has no known price (set compute.price_per_hour)."""
    costs = [r.cost_usd for r in rows]
    return None if any(c is None for c in costs) else round(sum(c for c in costs if c is not None), 4)
