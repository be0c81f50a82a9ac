"""The cost table: billable time times the instances' hourly price."""

import io

from rich.console import Console

from tests.conftest import ON_S3, quickstart_data
from trnflow.cli.render import cost_table
from trnflow.reporting.cost import job_cost, price_per_hour, stage_cost, total
from trnflow.reporting.ledger import JobLedger, LedgerEntry
from trnflow.reporting.report import cost_markdown, price_basis
from trnflow.results import Cost, CostRow
from trnflow.specs import validate_spec
from trnflow.specs.instances import PRICES, SERVICES, TRAINING_TYPES, price


def _spec(backend: str = "local", **compute):
    """A 4-node trn1.32xlarge spec on `backend` (a cloud job keeps its checkpoints on S3)."""
    train = {"global_batch_size": 128, **({} if backend == "local" else {"checkpoint_url": "s3://acme-ckpt/run"})}
    return validate_spec(quickstart_data(compute={"backend": backend, "instance_type": "trn1.32xlarge", "nodes": 4,
                                                  "cores_per_node": 32, **compute}, train=train,
                                         **({} if backend == "local" else ON_S3)))


def test_a_job_costs_its_billable_time_on_every_node_at_the_hourly_price():
    spec = validate_spec(quickstart_data(compute={"instance_type": "trn1.32xlarge", "nodes": 4, "cores_per_node": 32},
                                         train={"global_batch_size": 128}))
    row = job_cost(spec, "train", 6033)
    assert row == CostRow(stage="train", instance_type="trn1.32xlarge", nodes=4, jobs=1, price_per_node_hour=21.50,
                          billable_seconds=6033, cost_usd=round(21.50 * 4 * 6033 / 3600, 4), service="ec2",
                          region="us-east-1", price_as_of="2026-08-26")
    assert total([row, job_cost(spec, "infer", 60)]) == round(21.50 * 4 * 6093 / 3600, 4)


def test_the_spec_price_overrides_the_catalogue_and_an_unknown_price_says_so():
    trn2 = _spec("sagemaker", instance_type="trn2.48xlarge", nodes=1, cores_per_node=2)
    assert price_per_hour(trn2) is None  # no reliable public figure for ml.trn2.48xlarge
    rows = [job_cost(trn2, "train", 100)]
    assert rows[0].cost_usd is None and total(rows) is None
    console = Console(file=io.StringIO(), width=200)
    console.print(cost_table(Cost(rows=rows, total_usd=None)))
    shown = console.file.getvalue()
    assert "set compute.price_per_hour" in shown and "sagemaker: no price known" in shown
    priced = _spec("sagemaker", instance_type="trn2.48xlarge", nodes=1, cores_per_node=2, price_per_hour=40.0)
    row = job_cost(priced, "train", 90)
    assert row.cost_usd == 1.0 and row.region is None and price_basis(row) == "compute.price_per_hour"


def test_a_stage_that_ran_its_job_twice_costs_both_and_says_so():
    spec = validate_spec(quickstart_data(compute={"instance_type": "trn1.32xlarge"}))
    row = job_cost(spec, "train", 1800 + 600, jobs=2)  # a failed job of 10 minutes, then the one that finished
    assert row.jobs == 2 and row.cost_usd == round(21.50 * 2400 / 3600, 4)
    assert ("- **train**: 1x trn1.32xlarge at $21.5 per node-hour (ec2 us-east-1, 2026-08-26), 2 jobs, 2400.0 s "
            "billable: **$14.3333**" in cost_markdown(Cost(rows=[row], total_usd=row.cost_usd)))


def test_the_ledger_hands_each_job_to_its_reader_once_whoever_wrote_it(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

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


def test_sagemaker_jobs_are_billed_at_sagemakers_ml_price_and_batch_and_local_ones_at_ec2s():
    sagemaker, batch, local = (job_cost(_spec(backend), "train", 3600) for backend in ("sagemaker", "batch", "local"))
    assert (sagemaker.service, sagemaker.price_per_node_hour, sagemaker.cost_usd) == ("sagemaker", 24.725, 98.9)
    assert sagemaker.price_per_node_hour > 1.14 * batch.price_per_node_hour  # SageMaker's price is ~15% above EC2's
    for row in (batch, local):  # Batch runs EC2 instances; the emulator says what they would have cost
        assert (row.service, row.price_per_node_hour, row.cost_usd) == ("ec2", 21.50, 86.0)
    shown = cost_markdown(Cost(rows=[sagemaker], total_usd=sagemaker.cost_usd))
    assert ("- **train**: 4x ml.trn1.32xlarge at $24.725 per node-hour (sagemaker us-east-1, 2026-11-25), 1 job, "
            "3600.0 s billable: **$98.9000**\n" in shown)  # a run that started no counted instance says none
    assert job_cost(_spec("sagemaker", price_per_hour=20.0), "train", 3600).cost_usd == 80.0  # the spec's price wins


def test_every_catalogue_price_says_its_service_region_and_the_day_it_was_read():
    import datetime
    import re

    assert PRICES and {service for service, _ in PRICES} == set(SERVICES)
    for (service, itype), found in PRICES.items():
        assert (found.service, found.instance_type) == (service, itype) and found.usd_per_hour > 0
        assert re.fullmatch(r"[a-z]{2}-[a-z]+-\d", found.region), found
        assert datetime.date.fromisoformat(found.as_of) <= datetime.date(2026, 11, 25), found
    assert all(price("ec2", t) is not None for t in TRAINING_TYPES)  # trn2.48xlarge included
    assert price("ec2", "trn2.48xlarge").region == "us-east-2"
    assert price("sagemaker", "trn2.48xlarge") is None  # no reliable figure: the table says unknown
    for (service, itype), found in PRICES.items():
        if service == "sagemaker":
            assert found.usd_per_hour > price("ec2", itype).usd_per_hour and found.billed_as == f"ml.{itype}"


def test_the_compile_job_is_billed_on_the_one_node_it_held_not_the_training_jobs_nodes(tmp_path):
    from trnflow.backends import JobRequest
    from trnflow.backends.cloud import placement

    spec = _spec("batch")  # 4 nodes for training; the compile job runs one process, so on one node
    compile_nodes = placement(JobRequest(spec, "compile", "run-1", processes=1))[0]  # what run_job records
    assert compile_nodes == 1 and placement(JobRequest(spec, "train", "run-1"))[0] == 4
    ledger = JobLedger(tmp_path, "run-1")
    ledger.record(LedgerEntry("compile", "c1", "FAILED", 120.0, nodes=compile_nodes))
    ledger.record(LedgerEntry("compile", "c2", "SUCCEEDED", 600.0, nodes=compile_nodes))
    compile_row = stage_cost(spec, "compile", ledger.new_entries())
    assert (compile_row.nodes, compile_row.jobs, compile_row.billable_seconds) == (1, 2, 720.0)
    assert compile_row.cost_usd == round(21.50 * 720 / 3600, 4)
    ledger.record(LedgerEntry("train", "t1", "SUCCEEDED", 3600.0))
    train_row = stage_cost(spec, "train", ledger.new_entries())
    assert (train_row.nodes, train_row.cost_usd) == (4, 86.0)
    ledger.record(LedgerEntry("train", "t2", "SUCCEEDED", 3600.0, nodes=2))  # a job that held two
    assert stage_cost(spec, "train", ledger.new_entries()).cost_usd == 43.0


def test_each_job_is_billed_at_the_price_of_the_instance_type_it_got():
    spec = _spec("sagemaker", instance_preferences=["trn1.32xlarge", "trn1n.32xlarge"], nodes=2)
    first, second = (price("sagemaker", t).usd_per_hour for t in ("trn1.32xlarge", "trn1n.32xlarge"))
    row = stage_cost(spec, "train", [LedgerEntry("train", "a", "FAILED", 600.0, nodes=2),  # the spec's type
                                     LedgerEntry("train", "b", "SUCCEEDED", 1800.0, nodes=2,
                                                 instance_type="trn1n.32xlarge")])
    assert row.instance_type == "trn1n.32xlarge" and row.price_per_node_hour == second and row.jobs == 2
    assert row.cost_usd == round((first * 2 * 600 + second * 2 * 1800) / 3600, 4)


def test_a_batch_spot_job_costs_its_time_at_ec2s_spot_price_unless_the_spec_sets_a_price():
    spec = _spec("batch", spot=True, nodes=1)
    rate = price("ec2", "trn1.32xlarge").usd_per_hour
    entry = LedgerEntry("train", "a", "SUCCEEDED", 1000.0, nodes=1, spot=True, running_seconds=1000.0,
                        price_per_hour=round(rate * 0.3, 4))
    row = stage_cost(spec, "train", [entry])
    assert row.cost_usd == round(round(rate * 0.3, 4) * 1000 / 3600, 4)
    assert row.on_demand_usd == round(rate * 1000 / 3600, 4) and row.price_per_node_hour == round(rate * 0.3, 4)
    assert price_basis(row) == f"ec2 {row.region}, {row.price_as_of}; spot: EC2's spot price at each instance's launch"
    priced = _spec("batch", spot=True, nodes=1, price_per_hour=5.0)
    assert stage_cost(priced, "train", [entry]).cost_usd == round(5.0 * 1000 / 3600, 4)  # the spec's price wins


def test_spot_jobs_cost_their_billed_time_and_the_table_says_what_spot_saved():
    spec = _spec("sagemaker", spot=True, nodes=1)
    rate = price("sagemaker", "trn1.32xlarge").usd_per_hour
    row = stage_cost(spec, "train", [LedgerEntry("train", "a", "SUCCEEDED", 300.0, nodes=1, spot=True,
                                                 running_seconds=1000.0)])
    assert row.cost_usd == round(rate * 300 / 3600, 4) and row.on_demand_usd == round(rate * 1000 / 3600, 4)
    assert price_basis(row) == "sagemaker us-east-1, 2026-11-25; spot: the service's billable time"
    cost = Cost(rows=[row, job_cost(spec, "infer", 60)], total_usd=None)
    saved = round(rate * 700 / 3600, 2)
    assert f"Spot saved ${saved:,.2f} (70%) against the same running time on demand." in cost_markdown(cost)
    console = Console(file=io.StringIO(), width=300)
    console.print(cost_table(cost))
    assert "Spot saved" in console.file.getvalue()
