"""What a run costs: each job's billable time, on every node it held, at its instances' hourly price.

The price is the one the backend's service bills (`trnflow.specs.instances.BILLED_BY`): AWS Batch
launches EC2 instances and pays EC2's on-demand price; SageMaker bills its own, higher, `ml.*` price
for the same hardware. It comes from the instance catalogue's price table
(`trnflow.specs.instances.PRICES`), with the region and the day it was read, unless the spec sets
`compute.price_per_hour`, which always wins. The local emulator bills nothing: its jobs are priced
as EC2 instances of the spec's type, and a job's billable time is its wall time, so its rows say
what the same jobs would have cost on the instances the spec names.

A job is billed on the nodes it held: the compile job runs one worker process, so it holds one
node whatever `compute.nodes` says. A job that failed and was submitted again costs its time too.
A cloud job's billable time is what its service bills from its instances' start
(`trnflow.backends.provisioning`), and each row counts the instances its jobs started and the time
they took to be ready.
"""

from __future__ import annotations

from typing import Any

from trnflow.reporting.ledger import LedgerEntry
from trnflow.results import Cost, CostRow
from trnflow.specs import JobSpec
from trnflow.specs.instances import BILLED_BY, Price, instance_cost, price


def service(spec: JobSpec) -> str:
    """The service that bills `spec`'s instances."""
    return BILLED_BY[spec.compute.backend]


def catalogue_price(spec: JobSpec) -> Price | None:
    """The price table's entry for the spec's service and instance type; None when none is known."""
    return price(service(spec), spec.compute.instance_type)


def price_per_hour(spec: JobSpec) -> float | None:
    """USD per instance-hour: the spec's `compute.price_per_hour`, else the catalogue's price for the
    backend's service; None when neither is known."""
    return spec.compute.hourly_price


def job_cost(spec: JobSpec, stage: str, billable_seconds: float, jobs: int = 1, nodes: int | None = None
             ) -> CostRow:
    """One row of the cost table, in the shape of the usual price-performance tables: a stage's
    `jobs` (its failed attempts included), their billable time per node together, and the `nodes`
    each held (by default, the spec's)."""
    nodes = spec.compute.nodes if nodes is None else nodes
    rate = price_per_hour(spec)
    found = None if spec.compute.price_per_hour is not None else catalogue_price(spec)
    return CostRow(stage=stage, instance_type=spec.compute.instance_type, nodes=nodes, jobs=jobs,
                   price_per_node_hour=rate, billable_seconds=round(billable_seconds, 1),
                   cost_usd=None if rate is None else round(instance_cost(rate, nodes, billable_seconds), 4),
                   service=service(spec), region=found.region if found else None,
                   price_as_of=found.as_of if found else None)


def stage_cost(spec: JobSpec, stage: str, entries: list[LedgerEntry]) -> CostRow:
    """The cost row of the jobs a stage ran, from its ledger entries: each billed on the nodes it
    held and at the price of the instance type it got, as `run_job` recorded them (an entry that
    does not say: the spec's). The row's time is the jobs' time per node; its nodes the most any
    job held; its instance type the last job's."""
    held = [e.nodes if e.nodes is not None else spec.compute.nodes for e in entries]
    last = _on(spec, entries[-1].instance_type if entries else None)
    row = job_cost(last, stage, sum(e.seconds for e in entries), jobs=len(entries),
                   nodes=max(held, default=spec.compute.nodes))
    rates = [price_per_hour(_on(spec, e.instance_type)) for e in entries]
    paid = [r if e.price_per_hour is None or spec.compute.price_per_hour is not None else e.price_per_hour
            for r, e in zip(rates, entries, strict=True)]  # a spot job's own price, unless the spec sets one
    if row.price_per_node_hour is not None:  # exact also when its jobs held different numbers of nodes
        if any(rate is None for rate in rates):
            row.cost_usd = None
        else:
            row.cost_usd = round(sum(instance_cost(r, n, e.seconds)
                                     for r, n, e in zip(paid, held, entries, strict=True)), 4)
            if any(e.spot for e in entries):  # the same running time at the on-demand price
                row.on_demand_usd = round(sum(instance_cost(r, n, e.running_seconds or e.seconds)
                                              for r, n, e in zip(rates, held, entries, strict=True)), 4)
                if entries[-1].price_per_hour is not None and spec.compute.price_per_hour is None:
                    row.price_per_node_hour = entries[-1].price_per_hour  # the spot price, as billed
    row.instances_started = _sum([e.instances_started for e in entries])
    row.provisioning_seconds = _sum([e.provisioning_seconds for e in entries])
    return row


def _sum(values: list) -> Any:
    """The sum of the values that are known; None when none is."""
    known = [v for v in values if v is not None]
    return round(sum(known), 1) if known else None


def run_cost(rows: list[CostRow]) -> Cost:
    """The run's cost table: its rows, its total, and the instances its jobs started."""
    return Cost(rows=rows, total_usd=total(rows), instances_started=_sum([r.instances_started for r in rows]),
                provisioning_seconds=_sum([r.provisioning_seconds for r in rows]))


def spot_savings(cost: Cost) -> tuple[float, float] | None:
    """(USD saved, share saved) by the run's spot jobs against the same running time on demand; None
    when no priced job ran on spot."""
    spot = [r for r in cost.rows if r.on_demand_usd is not None and r.cost_usd is not None]
    on_demand = sum(r.on_demand_usd or 0.0 for r in spot)
    if not spot or not on_demand:
        return None
    saved = on_demand - sum(r.cost_usd or 0.0 for r in spot)
    return round(saved, 4), saved / on_demand


def _on(spec: JobSpec, instance_type: str | None) -> JobSpec:
    """`spec` priced on the instance type a job got; the spec's own when the entry does not say, or
    names a type the spec does not list (a price set by hand still applies)."""
    if instance_type is None or instance_type not in spec.compute.instance_choices:
        return spec
    return spec.on_instance(instance_type)


def total(rows: list[CostRow]) -> float | None:
    """The run's cost; None when any instance has no known price (set compute.price_per_hour)."""
    costs = [r.cost_usd for r in rows]
    return None if any(c is None for c in costs) else round(sum(c for c in costs if c is not None), 4)
