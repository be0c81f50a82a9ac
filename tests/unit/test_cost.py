"""The cost table: billable time times the instances' hourly price."""

import io

from rich.console import Console

from tests.conftest import quickstart_data
from trnflow.cli.render import cost_table
from trnflow.reporting.cost import job_cost, price_per_hour, total
from trnflow.results import Cost, CostRow
from trnflow.specs import validate_spec


def test_a_job_costs_its_billable_time_on_every_node_at_the_hourly_price():
    spec = validate_spec(quickstart_data(compute={"instance_type": "trn1.32xlarge", "nodes": 4, "cores_per_node": 32},
                                         train={"global_batch_size": 128}))
    row = job_cost(spec, "train", 6033)
    assert row == CostRow(stage="train", instance_type="trn1.32xlarge", nodes=4, jobs=1, price_per_node_hour=21.50,
                          billable_seconds=6033, cost_usd=round(21.50 * 4 * 6033 / 3600, 4))
    assert total([row, job_cost(spec, "infer", 60)]) == round(21.50 * 4 * 6093 / 3600, 4)


def test_the_spec_price_overrides_the_catalogue_and_an_unknown_price_says_so():
    trn2 = validate_spec(quickstart_data(compute={"instance_type": "trn2.48xlarge"}))
    assert price_per_hour(trn2) is None  # no reliable public figure
    rows = [job_cost(trn2, "train", 100)]
    assert rows[0].cost_usd is None and total(rows) is None
    console = Console(file=io.StringIO(), width=150)
    console.print(cost_table(Cost(rows=rows, total_usd=None)))
    assert "set compute.price_per_hour" in console.file.getvalue()
    priced = validate_spec(quickstart_data(compute={"instance_type": "trn2.48xlarge", "price_per_hour": 40.0}))
    assert job_cost(priced, "train", 90).cost_usd == 1.0


def test_a_stage_that_ran_its_job_twice_costs_both_and_says_so():
    from trnflow.reporting.report import cost_markdown

    spec = validate_spec(quickstart_data(compute={"instance_type": "trn1.32xlarge"}))
    row = job_cost(spec, "train", 1800 + 600, jobs=2)  # a failed job of 10 minutes, then the one that finished
    assert row.jobs == 2 and row.cost_usd == round(21.50 * 2400 / 3600, 4)
    assert "| train | trn1.32xlarge | 1 | 2 | 21.5 | 2400.0 | 14.3333 |" in cost_markdown(Cost(rows=[row],
                                                                                         total_usd=row.cost_usd))


def test_the_ledger_hands_each_job_to_its_reader_once_whoever_wrote_it(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from trnflow.reporting.ledger import JobLedger, LedgerEntry

    reader = JobLedger(tmp_path, "run-1")
    assert reader.new_entries() == []
    with ThreadPoolExecutor(4) as pool:  # tasks run in threads: every writer opens the ledger itself
        list(pool.map(lambda i: JobLedger(tmp_path, "run-1").record(LedgerEntry("train", f"j{i}", "FAILED", 1.5)),
                      range(8)))
    first = reader.new_entries()
    assert sorted(e.job_id for e in first) == [f"j{i}" for i in range(8)] and sum(e.seconds for e in first) == 12.0
    JobLedger(tmp_path, "run-1").record(LedgerEntry("train", "j8", "SUCCEEDED", 2.0))
    assert reader.new_entries() == [LedgerEntry("train", "j8", "SUCCEEDED", 2.0)]
    assert reader.new_entries() == [] and JobLedger(tmp_path, "run-2").new_entries() == []
