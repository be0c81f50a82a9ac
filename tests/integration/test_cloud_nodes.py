"""A cloud job's nodes: a node that fails the preflight, a bad core excluded inside the
allocation, a node that hangs in the preflight, and a main node left stalling by the other's
failure (AWS Batch's multi-node jobs in MockCloud)."""


import time

import pytest

from tests.clouds import (
    cloud_spec,
    in_cloud,
    our_batch_jobs,
    s3_keys,
)
from trnflow.backends import JobRequest, wait
from trnflow.flows.pipeline import pipeline
from trnflow.settings import TrnflowSettings


@pytest.mark.slow
def test_a_node_that_fails_the_cloud_preflight_never_trains(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """A two-node Batch job whose second node has a corrupt NeuronCore on every instance that serves
    it: each attempt's sanity phase names the core and the node, whose instance (as Batch and ECS
    place it: the node's container cannot reach the metadata service) trnflow terminates and Batch's
    retry replaces (exit code 79); when the retries are used up the stage fails, and no step is
    trained anywhere."""
    import boto3

    began = time.time() * 1000
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, node_faults={1: "corrupt@0"}) as (_, bucket):
        spec = cloud_spec(make_spec, bucket, "batch")  # preflight.exclude_bad_cores is off
        state = pipeline(spec, run_id="a-bad-node", return_state=True)
        assert state.is_failed()
        stages = state.result(raise_on_failure=False).stages
        assert [(r.stage, r.state) for r in stages] == [("sanity", "Failed")]
        summary = stages[0].summary
        assert "NeuronCore(s) [0] failed known-answer tests" in summary and "is replaced" in summary, summary
        assert "nc0 of node 1 (" in summary and "AWS Batch retried" in summary  # the node, by its host name
        (job,) = our_batch_jobs(began)
        assert job["tags"]["trnflow:phase"] == "sanity+train" and job["status"] == "FAILED"
        attempts = job["attempts"]
        assert len(attempts) == 1 + spec.retries.max_retries  # Batch retried it; trnflow did not resubmit
        assert all(a["container"].get("exitCode") == 79 for a in attempts), attempts
        (node1,) = boto3.client("batch").describe_jobs(jobs=[f"{job['jobId']}#1"])["jobs"]  # where Batch placed it
        placed = [a["container"]["containerInstanceArn"] for a in node1["attempts"]]
        assert len(placed) == len(set(placed)) == len(attempts)  # node 1 got a new instance for every retry
        assert not s3_keys(boto3.client("s3"), bucket, "checkpoints/a-bad-node/"), "nothing was trained"
        logs = "".join(p.read_text() for p in (tmp_path / "cloud").rglob("container.log"))
        assert '"event": "sanity"' in logs and '"event": "train"' not in logs


@pytest.mark.slow
def test_a_bad_core_is_excluded_inside_the_allocation_and_training_runs_on_the_cores_checked_again(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """preflight.exclude_bad_cores on a two-node Batch job whose node 1 has a corrupt nc0: the main
    node places node 1 on nc1 instead, both nodes check their cores again, and training runs on them,
    in the same job, on the same instances, in its first attempt."""
    import boto3

    began = time.time() * 1000
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, node_faults={1: "corrupt@0"},
                  compile_cache=warmed_cache) as (_, bucket):  # the faults are the subject, not compiling
        spec = cloud_spec(make_spec, bucket, "batch", train={"steps": 20}, gate={"eval_every": None},
                           preflight={"exclude_bad_cores": True}, registry_url=f"s3://{bucket}/registry-excluded")
        state = pipeline(spec, run_id="a-core-excluded", return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        sanity = outcome.results["sanity"]
        assert sanity.excluded_cores == [0] and "excluded bad core(s) [0]" in sanity.summary
        assert sorted((c.rank, c.core, c.passed) for c in sanity.per_core) == [(0, 0, True), (1, 1, True)]
        assert sanity.ran_on == outcome.results["train"].ran_on
        (job,) = [j for j in our_batch_jobs(began) if j["tags"]["trnflow:phase"] == "sanity+train"]
        assert [a["container"].get("exitCode") for a in job["attempts"]] == [0]  # no instance was replaced
        staging = bucket.replace("-data-", "-staging-")  # where the job's nodes leave what they tell each other
        placed = [k for k in s3_keys(boto3.client("s3"), staging, "jobs/a-core-excluded/") if k.endswith(
            "phases/placement-1-1.json")]
        assert len(placed) == 1, "the main node chose other cores for node 1, once"
        main = (tmp_path / "cloud" / "batch" / job["jobId"] / "attempt-1" / "node-0" / "container.log").read_text()
        assert main.count("checking again without them (cores by node: {0: '0', 1: '1'})") == 1
        assert main.count('"event": "sanity", "rank": 0') == 2 and '"event": "train"' in main  # checked twice, trained
        assert outcome.results["train"].steps == 20


@pytest.mark.slow
def test_a_node_that_hangs_in_the_batch_preflight_is_replaced_and_training_runs_on_checked_instances(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """The instance serving node 1 of a two-node Batch job hangs in the preflight's first collective.
    Node 0 names the hang when the collective times out; the job exits 79 (BadHost); trnflow
    terminates the job's instances (which of the two hung, the other cannot tell); Batch's retry runs
    on new instances, whose preflight passes, and training runs on exactly those."""
    import boto3

    began = time.time() * 1000
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, host_faults={1: "hang@0"},
                  compile_cache=warmed_cache) as (cloud, bucket):
        spec = cloud_spec(make_spec, bucket, "batch", train={"steps": 20}, gate={"eval_every": None},
                           preflight={"collective_timeout_seconds": 10},
                           registry_url=f"s3://{bucket}/registry-hung-node")  # no other test's champion
        state = pipeline(spec, run_id="a-hung-node", return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        (hung,) = cloud.bad_hosts  # the EC2 instance that took the fault
        results = outcome.results
        sanity, collectives, train = (results[s].ran_on for s in ("sanity", "collectives", "train"))
        assert sanity == collectives == train and len(set(train.hosts)) == 2 and hung not in train.hosts
        (job,) = [j for j in our_batch_jobs(began) if j["tags"]["trnflow:phase"] == "sanity+train"]
        assert train.job_id == job["jobId"]
        ended = [(a["container"].get("exitCode"), a["statusReason"]) for a in job["attempts"]]
        assert len(ended) == 2 and ended[-1][0] == 0, ended  # one retry: the bad instance was gone before it
        assert ended[0][0] == 79 or ended[0][1].startswith("Host EC2"), ended  # exited, or terminated first
        (state_of_hung,) = [i["State"]["Name"] for r in boto3.client("ec2").describe_instances(
            InstanceIds=[hung])["Reservations"] for i in r["Instances"]]
        assert state_of_hung == "terminated"
        first = (tmp_path / "cloud" / "batch" / job["jobId"] / "attempt-1").rglob("container.log")
        assert '"event": "train"' not in "".join(p.read_text() for p in first)  # it never trained
        assert results["train"].start_step == 0 and results["train"].steps == 20


@pytest.mark.slow
def test_a_slow_host_named_in_training_is_replaced_before_the_retry_of_its_failed_attempt(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """The instance serving node 1 of a two-node Batch job is slow (its rank's own work in each step
    takes three times as long), and rank 0 names it at step 6 (its first window of five steps). Rank 0 is
    then killed at step 8: the attempt fails (exit code 75), the main node's report names node 1 a
    suspect host, and trnflow terminates its instance, as the services say the node ran on it,
    before Batch's retry; that runs on a new instance and resumes from step 4's checkpoint."""
    import boto3

    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import cloud_target, node_reports

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, host_faults={1: "slow@0"},
                  node_faults={0: "kill@0:train:8"}, compile_cache=warmed_cache) as (cloud, bucket):
        spec = cloud_spec(make_spec, bucket, "batch", train={"steps": 10, "checkpoint_every": 4, "log_every": 1},
                           gate={"eval_every": None})
        backend = BatchBackend(cloud_target(TrnflowSettings(), "batch"))
        job = backend.submit(JobRequest(spec, "train", "a-slow-host"))
        info = wait(backend, job, 0.5)
        assert info.state.value == "SUCCEEDED", info
        (slow,) = cloud.bad_hosts  # the EC2 instance that took the fault
        (described,) = boto3.client("batch").describe_jobs(jobs=[job])["jobs"]
        ended = [(a["container"].get("exitCode"), a["statusReason"]) for a in described["attempts"]]
        assert len(ended) == 2 and ended[-1][0] == 0, ended  # one retry, on other instances
        assert ended[0][0] == 75 or ended[0][1].startswith("Host EC2"), ended  # exited, or terminated first
        (report,) = [r for node, r in node_reports(backend.outputs(job), 0) if node == 0]  # the first attempt's
        assert report.type == "WorkerLost" and 1 in report.nodes, report
        assert "suspect host(s), replaced before the next attempt: node 1 (" in report.message
        assert "x its peers' median step" in report.message
        (state,) = [i["State"]["Name"] for r in boto3.client("ec2").describe_instances(
            InstanceIds=[slow])["Reservations"] for i in r["Instances"]]
        assert state == "terminated"
        (node1,) = boto3.client("batch").describe_jobs(jobs=[f"{job}#1"])["jobs"]  # where Batch placed it
        placed = [a["container"]["containerInstanceArn"] for a in node1["attempts"]]
        assert len(placed) == len(set(placed)) == 2  # node 1 got a new instance for the retry
        assert info.result.start_step == 4 and info.result.steps == 10


@pytest.mark.parametrize("service", ["batch", "sagemaker"])
def test_a_job_whose_other_node_failed_while_the_main_node_stalls_is_stopped(
        service, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """Node 0's rank stops making progress at step 3 (its host stopped answering); node 1's rank
    times out in the step's all-reduce and its container fails. Neither service ends a job before its
    main node does, and the main node would sleep until the attempt's timeout. The backend, which
    watches every node, stops the job with node 1's transient failure, so the stage is resubmitted."""
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import STOPPED_BY_TRNFLOW, NodeWatch, cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, node_faults={0: "stall@0:train:3"},
                  compile_cache=warmed_cache) as (cloud, bucket):  # the stall is the subject, not compiling
        cloud.stop_grace_seconds = cloud.sagemaker_stop_grace_seconds = 2.0  # the stalled rank never reaches the
        # step boundary at which training acts on SIGTERM
        spec = cloud_spec(make_spec, bucket, service, preflight={"collective_timeout_seconds": 5},
                           compute={"nodes": 2, "cores_per_node": 1, "instance_type": "trn1.32xlarge"},
                           train={"steps": 6, "checkpoint_every": 2, "global_batch_size": 32})
        kind = BatchBackend if service == "batch" else SageMakerBackend
        backend = kind(cloud_target(TrnflowSettings(), service))
        backend.nodes = NodeWatch(grace=2.0, every=0.5)
        job = backend.submit(JobRequest(spec, "train", f"stall-{service}"))
        info = wait(backend, job, 0.5)
        assert info.state.value == "FAILED"
        failure = info.failure
        assert failure.type == "CollectiveTimeout" and failure.retryable is True, failure
        assert "node 1 of " in failure.message and "failed while its main node went on" in failure.message
        if service == "batch":
            import boto3

            (described,) = boto3.client("batch").describe_jobs(jobs=[job])["jobs"]
            assert described["statusReason"].startswith(f"{STOPPED_BY_TRNFLOW}node 1 failed (CollectiveTimeout)")
        cloud.wait_idle(60)
        assert not any(thread.is_alive() for thread in cloud._threads)  # the stalled main node was stopped too
