"""What a cloud job's instance starts were: how many, how long they took to be ready, and (on
Batch) what EC2 bills from their launch; and how the cost table carries them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.conftest import ON_S3, quickstart_data
from trnflow.backends.provisioning import batch_provisioning, sagemaker_provisioning
from trnflow.reporting.cost import run_cost, stage_cost
from trnflow.reporting.ledger import LedgerEntry
from trnflow.reporting.report import cost_markdown
from trnflow.results import NodeIdentity
from trnflow.specs import validate_spec

T0 = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


def _transitions(*spans: tuple[str, float]) -> list[dict]:
    """SageMaker's SecondaryStatusTransitions, each status lasting its seconds."""
    out, at = [], T0
    for status, seconds in spans:
        out.append({"Status": status, "StartTime": at, "EndTime": at + timedelta(seconds=seconds)})
        at += timedelta(seconds=seconds)
    return out


def test_each_sagemaker_start_that_got_instances_is_counted_with_its_wait():
    desc = {"ResourceConfig": {"InstanceCount": 2}, "SecondaryStatusTransitions": _transitions(
        ("Starting", 300), ("Downloading", 120), ("Training", 600),  # the first start
        ("Interrupted", 50), ("Starting", 200), ("Downloading", 100), ("Training", 900), ("Completed", 0))}
    found = sagemaker_provisioning(desc)
    assert (found.instances_started, found.seconds, found.billable_seconds) == (4, 720.0, None)
    starved = {"ResourceConfig": {"InstanceCount": 2}, "SecondaryStatusTransitions": _transitions(
        ("Starting", 600), ("Failed", 0))}  # no capacity: nothing was launched
    assert sagemaker_provisioning(starved).instances_started == 0


def _node(node: int, attempt: int, instance: str, started: float) -> NodeIdentity:
    return NodeIdentity(node=node, attempt=attempt, host=f"ip-{node}", instance_id=instance, started_at=started)


def test_batch_bills_each_instance_from_its_launch_to_the_last_attempt_it_served():
    """Two nodes; the first attempt failed; its retry kept instance a and ran node 1 on a new one, c."""
    launched = {"i-a": 1000.0, "i-b": 1000.0, "i-c": 1500.0}
    identities = [_node(0, 1, "i-a", 1090.0), _node(1, 1, "i-b", 1100.0),  # 90 and 100 s to boot and pull
                  _node(0, 2, "i-a", 1505.0), _node(1, 2, "i-c", 1580.0)]  # a was ready; c took 80 s
    desc = {"attempts": [{"startedAt": 1_090_000, "stoppedAt": 1_400_000},
                         {"startedAt": 1_505_000, "stoppedAt": 2_000_000}]}
    found = batch_provisioning(desc, identities, launched, nodes=2)
    assert found is not None and found.instances_started == 3
    assert found.seconds == 100 + 80  # each attempt waited for its slowest new instance
    # a: 1000..2000, b: 1000..1400 (its last attempt), c: 1500..2000; per node of the two
    assert found.billable_seconds == (1000 + 400 + 500) / 2
    assert found.instance_seconds == {"i-a": 1000, "i-b": 400, "i-c": 500}  # each priced at its own spot price
    # a job placed on an instance the compute environment held from an earlier job: not started for it,
    # billed from its submission
    later = {"createdAt": 1_800_000, "attempts": [{"startedAt": 1_805_000, "stoppedAt": 2_100_000}]}
    reused = batch_provisioning(later, [_node(0, 1, "i-a", 1805.0)], launched, nodes=1)
    assert reused is not None and (reused.instances_started, reused.seconds) == (0, 0.0)
    assert reused.billable_seconds == 2100 - 1800
    unnamed = [n.model_copy(update={"instance_id": None}) for n in identities]
    assert batch_provisioning(desc, unnamed, launched, nodes=2) is None  # no metadata service: not known


def test_the_cost_table_counts_the_instances_each_stage_started_and_their_wait():
    spec = validate_spec(quickstart_data(compute={"backend": "batch", "instance_type": "trn1.32xlarge", "nodes": 2,
                                                  "cores_per_node": 1}, train={"checkpoint_url": "s3://a-b/c"},
                                         **ON_S3))
    train = stage_cost(spec, "train", [
        LedgerEntry("sanity+train", "j1", "FAILED", 300.0, nodes=2, instances_started=2, provisioning_seconds=95.0),
        LedgerEntry("sanity+train", "j2", "SUCCEEDED", 900.0, nodes=2, instances_started=2, provisioning_seconds=85.0)])
    local = stage_cost(spec, "compile", [LedgerEntry("compile", "j3", "SUCCEEDED", 60.0, nodes=1)])
    assert (train.instances_started, train.provisioning_seconds) == (4, 180.0)
    assert (local.instances_started, local.provisioning_seconds) == (None, None)
    cost = run_cost([train, local])
    assert (cost.instances_started, cost.provisioning_seconds) == (4, 180.0)
    shown = cost_markdown(cost)
    assert "- **train**: 2x trn1.32xlarge at $21.5 per node-hour (ec2 us-east-1, 2026-08-26), 2 jobs, " in shown
    assert "s billable; 4 instances started, 180.0 s to provision: **$" in shown
    assert "- **compile**: 1x trn1.32xlarge at $21.5 per node-hour (ec2 us-east-1, 2026-08-26), 1 job, 60.0 s " \
        "billable: **$0.3583**" in shown  # on this machine: no instance started
    assert "; 4 instances started, 180.0 s to provision.\n" in shown  # the total's
