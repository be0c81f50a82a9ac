"""The container's side of one allocation for several phases: who each node is (EC2's metadata
service), what ends the job after a preflight phase (and with which exit code), and waiting for the
orchestrator's word."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import boto3
import pytest
from moto import mock_aws

from trnflow.aws import InstanceMetadata
from trnflow.backends import container
from trnflow.backends.container import (
    await_word,
    batch_rendezvous,
    identity,
    instance_metadata,
    next_placement,
    preflight_failure,
    with_suspects,
)
from trnflow.errors import ExitCode
from trnflow.results import (
    CollectivesResult,
    FailureReport,
    NodeIdentity,
    Proceed,
    SanityResult,
    SlowRank,
    SlowRanks,
)
from trnflow.storage import open_store
from trnflow.testing.mockcloud.instances import Instances


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(container, "PROCEED_POLL_SECONDS", 0.01)


def _sanity(bad: list[int], sweep_passed: bool = True) -> SanityResult:
    """Two nodes of one core each: rank r is nc0 of node r."""
    sweep = CollectivesResult(ranks=2, rows=[], avg_busbw=None, passed=sweep_passed, bad_cores=[] if sweep_passed
                              else [0], note=None if sweep_passed else "all_reduce: rank 1 sent wrong data")
    return SanityResult(per_core=[{"rank": r, "core": 0, "passed": r not in bad, "failed": [] if r not in bad else
                                   ["memory/patterns/int32"]} for r in (0, 1)],
                        bad_cores=[0] if bad else [], passed=not bad, collectives=sweep)


def test_a_preflight_with_a_bad_core_or_a_wrong_sweep_has_the_hosts_at_fault_replaced():
    nodes = {r: NodeIdentity(node=r, host=f"ip-10-0-0-{r}", instance_id=f"i-0{r}", started_at=0.0) for r in (0, 1)}
    assert preflight_failure(_sanity([]), nodes, 1, 2) is None
    bad = preflight_failure(_sanity([1]), nodes, 1, 2)
    assert bad is not None and bad.type == "BadHost" and bad.retryable and bad.bad_cores == [0]
    assert bad.instances == ["i-01"] and bad.nodes == [1]  # the node whose core failed, alone
    assert "nc0 of node 1 (i-01): memory/patterns/int32" in bad.message and "is replaced" in bad.message
    wrong = preflight_failure(_sanity([], sweep_passed=False), nodes, 1, 2)
    assert wrong is not None and wrong.type == "BadHost" and "rank 1 sent wrong data" in wrong.message
    assert wrong.instances == ["i-00", "i-01"] and wrong.nodes == [0, 1]  # which one is at fault is not known
    unknown = preflight_failure(_sanity([1]), {}, 1, 2)  # a multi-node job's nodes cannot read their instance
    assert unknown is not None and unknown.instances == [] and unknown.nodes == [1]  # named by node only


def test_a_failed_attempt_names_the_hosts_of_its_hung_and_slow_ranks_as_suspects(tmp_path):
    nodes = {r: NodeIdentity(node=r, host=f"ip-10-0-0-{r}", started_at=0.0) for r in range(3)}
    slow = SlowRank(rank=5, core=1, host="node 2", step=20, own_seconds=0.2, peers_seconds=0.1, ratio=2.0)
    stalled = FailureReport(type="Stalled", retryable=True, rank=0, ranks=[2, 3], message="rank 0 waited")
    named = with_suspects(stalled, [slow], per_node=2, identities=nodes)  # ranks 2 and 3 on node 1, 5 on node 2
    assert named.nodes == [1, 2] and named.type == "Stalled" and named.retryable
    assert named.message == ("rank 0 waited; suspect host(s), replaced before the next attempt: node 1 (ip-10-0-0-1):"
                             " rank 2 held the step up, rank 3 held the step up; node 2 (ip-10-0-0-2): rank 5 (nc1 on "
                             "node 2): 2.0x its peers' median step")
    lost = FailureReport(type="WorkerLost", retryable=True, ranks=[0], message="rank 0 exited")
    assert with_suspects(lost, [], 2) == lost  # a rank that died names no host: it may have been killed
    assert with_suspects(lost, [slow], 2).nodes == [2]
    fatal = FailureReport(type="FatalError", retryable=False, message="bad spec")
    assert with_suspects(fatal, [slow], 2) == fatal  # no next attempt to place elsewhere

    output = tmp_path / "output"
    output.mkdir()
    assert container._slow_ranks(output) == []
    (output / SlowRanks.FILE).write_text(SlowRanks(slow=[slow]).model_dump_json())
    assert container._slow_ranks(output) == [slow]
    (output / SlowRanks.FILE).write_text('{"slow": [{"rank": "five"}]}')  # not worth failing over: ignored
    assert container._slow_ranks(output) == []


def test_a_bad_host_exits_with_the_code_batch_retries_on_other_instances(tmp_path, monkeypatch):
    report = FailureReport(type="BadHost", retryable=True, message="preflight: nc0 failed", instances=["i-01"])
    monkeypatch.setattr(container, "run_phases", lambda *args: (1, report))
    monkeypatch.setattr(container, "_fetch_spec", lambda env, into: tmp_path / "spec.json")
    monkeypatch.setenv("TRNFLOW_OUTPUT_DIR", str(tmp_path / "output"))
    assert container.main(["batch"]) == ExitCode.BAD_HOST == 79
    monkeypatch.setattr(container, "run_phases", lambda *args: (1, report.model_copy(update={"type": "Stalled"})))
    assert container.main(["batch"]) == ExitCode.TRANSIENT


def test_the_nodes_wait_for_the_word_and_the_others_for_the_main_node_too(tmp_path, fast):
    outputs = open_store(str(tmp_path))
    outputs.write("proceed-train.json", Proceed(phase="train", go=True).model_dump_json().encode())
    assert await_word(outputs, "train", "sanity", True, [], timeout=5).go  # the main node: the word is enough
    # another node also waits for the main node's end of the phase before (the same rendezvous port)
    waited = await_word(outputs, "train", "sanity", False, [], timeout=0.2)
    assert not waited.go and "no word from the orchestrator within" in waited.reason
    outputs.write("phases/sanity.json", b"{}")
    assert await_word(outputs, "train", "sanity", False, [], timeout=5).go
    # a retried attempt's node does not take the last attempt's phase for this one's
    stale = await_word(outputs, "train", "sanity", False, [], timeout=0.2, since=time.time() + 60)
    assert not stale.go
    outputs.write("proceed-train.json", Proceed(phase="train", go=False, reason="the run stopped").model_dump_json()
                  .encode())
    assert await_word(outputs, "train", "sanity", True, [], timeout=5).reason == "the run stopped"


def test_the_other_nodes_end_when_the_main_node_failed_the_preflight(tmp_path, fast):
    """No word comes for a job whose preflight failed: the other nodes do not wait for one."""
    outputs = open_store(str(tmp_path))
    began = time.time() - 5
    outputs.write("failure-node0.json", FailureReport(type="BadHost", message="nc0 failed").model_dump_json().encode())
    word = await_word(outputs, "train", "sanity", False, [], timeout=30, since=began)
    assert not word.go and word.reason == "the main node failed sanity"
    # the main node's failure in an earlier attempt is not this attempt's
    stale = await_word(outputs, "train", "sanity", False, [], timeout=0.2, since=time.time() + 60)
    assert not stale.go and "no word from the orchestrator" in stale.reason


def test_a_node_stopped_while_waiting_ends_saying_so(tmp_path, fast):
    word = await_word(open_store(str(tmp_path)), "train", "sanity", True, [15], timeout=60)
    assert not word.go and "SIGTERM" in word.reason


def test_each_instance_answers_its_own_id_and_type_over_imdsv2_only():
    with mock_aws():
        instances = Instances(boto3.client("ec2", region_name="us-east-1"))
        started = instances.start("trn1.32xlarge", 2)
        try:
            found = [instance_metadata({"AWS_EC2_METADATA_SERVICE_ENDPOINT": i.endpoint}) for i in started]
            assert found == [{"instance-id": i.instance_id, "instance-type": "trn1.32xlarge"} for i in started]
            assert len({i.instance_id for i in started}) == 2 and instances.started == [i.instance_id for i in started]
            with pytest.raises(urllib.error.HTTPError, match="401"):  # IMDSv1 (no token) is refused
                urllib.request.urlopen(f"{started[0].endpoint}/latest/meta-data/instance-id", timeout=5)  # noqa: S310
        finally:
            instances.stop(started)
    assert instance_metadata({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9"}, timeout=0.5) == {}
    assert instance_metadata({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "file:///etc/passwd"}) == {}


@pytest.mark.slow  # an instance's metadata service in moto: with the integration tests
def test_only_a_single_node_batch_job_asks_the_metadata_service_who_it_is():
    """A multi-node job's containers (awsvpc) are kept from the metadata service: they do not ask it,
    and the orchestrator reads where they ran from Batch and ECS."""
    with mock_aws():
        instances = Instances(boto3.client("ec2", region_name="us-east-1"))
        (host,) = instances.start("trn1.32xlarge", 1)
        try:
            env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": host.endpoint, "AWS_BATCH_JOB_ATTEMPT": "2"}
            alone = identity(env, "batch", batch_rendezvous(env, "10.0.0.5"))
            assert (alone.instance_id, alone.instance_type, alone.attempt) == (host.instance_id, "trn1.32xlarge", 2)
            asked = len(host.asked)
            node = env | {"AWS_BATCH_JOB_NODE_INDEX": "0", "AWS_BATCH_JOB_NUM_NODES": "2",
                          "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}
            one_of_two = identity(node, "batch", batch_rendezvous(node, "10.0.0.5"))
            assert one_of_two.instance_id is None and one_of_two.label == one_of_two.host
            assert len(host.asked) == asked  # never asked
        finally:
            instances.stop([host])


def test_a_spot_instance_tells_of_its_reclaim_only_once_ec2_gave_notice():
    """The reclaim notice is `spot/instance-action`: absent (404) until EC2 decides, then the action and
    its time. A metadata service that does not answer at all is asked once, not at every step."""
    with mock_aws():
        instances = Instances(boto3.client("ec2", region_name="us-east-1"))
        (spot,) = instances.start("trn1.2xlarge", 1)
        try:
            imds = InstanceMetadata({"AWS_EC2_METADATA_SERVICE_ENDPOINT": spot.endpoint})
            assert [imds.reclaim_notice() for _ in range(3)] == [None] * 3 and imds.answers
            assert spot.asked.count("PUT /latest/api/token") == 1  # one session token, kept across the 404s
            spot.notify_reclaim(120)
            notice = json.loads(imds.reclaim_notice() or "{}")
            assert notice["action"] == "terminate" and notice["time"].endswith("Z")
            assert imds.get("instance-id") == spot.instance_id  # the session token is kept between reads
        finally:
            instances.stop([spot])
    silent = InstanceMetadata({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "http://127.0.0.1:9"}, timeout=0.5)
    assert silent.reclaim_notice() is None and not silent.answers
    assert InstanceMetadata({"AWS_EC2_METADATA_SERVICE_ENDPOINT": "file:///etc/passwd"}).get("instance-id") is None


def test_bad_cores_are_placed_around_on_their_own_node_while_healthy_ones_remain():
    """Two nodes of one core each on 4-core instances: nc0 of node 1 failed."""
    first = next_placement(_sanity([1]), None, per_node=1, instance_cores=4, nnodes=2)
    assert first is not None and first.round == 1
    assert first.cores == {0: "0", 1: "1"} and first.excluded == {1: [0]}  # node 0 keeps its core
    again = SanityResult.model_validate({**_sanity([1]).model_dump(), "bad_cores": [1], "per_core": [
        {"rank": 0, "core": 0, "passed": True, "failed": []},
        {"rank": 1, "core": 1, "passed": False, "failed": ["x"]}]})
    second = next_placement(again, first, per_node=1, instance_cores=4, nnodes=2)
    assert second is not None and second.round == 2 and second.cores == {0: "0", 1: "2"}
    assert second.excluded == {1: [0, 1]}
    # two cores a node, aligned as the runtime places collective jobs: nc1 bad leaves nc2-nc3
    pair = SanityResult(per_core=[{"rank": 1, "core": 1, "passed": False, "failed": ["x"]}], bad_cores=[1],
                        passed=False)
    assert next_placement(pair, None, per_node=2, instance_cores=4, nnodes=1).cores == {0: "2-3"}
    assert next_placement(pair, None, per_node=2, instance_cores=2, nnodes=1) is None  # no healthy pair left
    assert next_placement(_sanity([], sweep_passed=False), None, 1, 4, 2) is None  # a sweep names no core
    assert next_placement(_sanity([1]), first, 1, 4, 2) is None  # nc0 failed again although excluded: no way round
