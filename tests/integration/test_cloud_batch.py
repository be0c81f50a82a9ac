"""The AWS Batch backend against moto, each multi-node job run for real by MockCloud under Batch's
contract: the pipeline through a lost host and a timeout, capacity, spot notices, fair share and
the retry strategy as the service reads them back."""

import json
import time

import pytest

from tests.clouds import HOST_LOST, assert_artifacts_in_s3, cloud_spec, in_cloud, our_batch_jobs
from trnflow.backends import JobRequest, wait
from trnflow.flows.pipeline import pipeline
from trnflow.settings import TrnflowSettings
from trnflow.testing.mockcloud import ServiceFault


@pytest.mark.slow
def test_the_pipeline_on_batch_two_nodes_survives_a_lost_host(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Through the moto server on 127.0.0.1. Every stage is a two-node Batch job. Training loses a
    host after its step-10 checkpoint; Batch's retry strategy retries it and the retry resumes, then
    meets an execution timeout at step 25, which the container reports with exit code 75; Batch
    retries that too, and the third attempt resumes from step 20."""
    import boto3

    faults = [ServiceFault("batch", "train", HOST_LOST, when="checkpoint")]
    began = time.time() * 1000
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, faults) as (_, bucket):
        spec = cloud_spec(make_spec, bucket, "batch", faults=[{"kind": "timeout", "core": 0, "step": 25}],
                          compute={"max_cost_usd": 1000.0})  # a budget training's kept job gets with its word
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        results = outcome.model_dump(mode="json")["results"]
        assert_artifacts_in_s3(spec, bucket, results)

        batch = boto3.client("batch")
        described = [j for j in our_batch_jobs(began) if j["status"] == "SUCCEEDED"]  # not earlier tests' jobs
        by_phase = {j["tags"]["trnflow:phase"]: j for j in described}
        # the preflight and training in one job, then compile and infer, nothing resubmitted
        # (evaluation ran inside the training phase, and the collectives inside the sanity phase,
        # across both nodes)
        assert set(by_phase) == {"sanity+train", "compile", "infer"}
        assert len(described) == len(by_phase)
        swept = results["collectives"]
        assert swept["phase"] == "sanity" and swept["ranks"] == spec.compute.world_size == 2
        hosts = {stage: results[stage]["ran_on"]["hosts"] for stage in ("sanity", "collectives", "train")}
        assert hosts["sanity"] == hosts["collectives"] and len(set(hosts["sanity"])) == 2
        # each retried attempt ran on new instances, which passed the preflight again before training
        assert len(set(hosts["train"])) == 2 and not set(hosts["train"]) & set(hosts["sanity"])
        running = boto3.client("ec2").describe_instances(InstanceIds=hosts["sanity"] + hosts["train"])
        assert {i["InstanceType"] for r in running["Reservations"] for i in r["Instances"]} == {
            spec.compute.instance_type}
        train = by_phase["sanity+train"]
        assert [(a["statusReason"], a["container"].get("exitCode")) for a in train["attempts"]] == [
            (HOST_LOST, None), ("Essential container in task exited", 75), ("Essential container in task exited", 0)]
        assert train["nodeProperties"]["numNodes"] == 2
        assert results["train"]["start_step"] == 20
        said, _ = _batch_backend().logs(train["jobId"], 0)  # the last attempt's stream: its budget, never the spec's
        budget = next(json.loads(line[line.index("{"):]) for line in said.splitlines() if '"event": "budget"' in line)
        assert 999 < budget["usd"] < 1000 and spec.train.max_cost_usd is None
        # issue 54: each job ran as a role made for it, named in a definition of its own; both are gone
        definitions = batch.describe_job_definitions(jobDefinitions=[j["jobDefinition"] for j in described])
        roles = {d["nodeProperties"]["nodeRangeProperties"][0]["container"]["jobRoleArn"]
                 for d in definitions["jobDefinitions"]}
        assert len(roles) == len(described) and all(":role/trnflow/trnflow-run-" in r for r in roles), roles
        assert {d["status"] for d in definitions["jobDefinitions"]} == {"INACTIVE"}
        assert not boto3.client("iam").list_roles(PathPrefix="/trnflow/")["Roles"]


def test_a_batch_job_left_runnable_for_lack_of_capacity_is_cancelled_and_the_next_instance_type_runs_it(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Batch leaves a job for trn1.32xlarge RUNNABLE while it has none. After compute.max_pending_minutes
    trnflow cancels it, naming the queue and the instance type, and submits the job again for the next
    of compute.instance_preferences; the stage records the type it got."""
    import boto3

    from trnflow.flows.preflight import preflight

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, no_capacity={"trn1.32xlarge"}) as (_, bucket):
        spec = cloud_spec(make_spec, bucket, "batch", compute={
            "instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"], "max_pending_minutes": 0.05})
        outcome = preflight(spec, run_id="fallback")
        sanity = outcome.results["sanity"]
        assert sanity.ran_on.backend == "batch" and sanity.ran_on.instance_type == "trn1n.32xlarge"
        batch = boto3.client("batch")
        failed = batch.list_jobs(jobQueue="trnflow-trn1", jobStatus="FAILED")["jobSummaryList"]
        (starved,) = batch.describe_jobs(jobs=[j["jobId"] for j in failed if j["jobName"].endswith("-fallback")]
                                         )["jobs"]  # the moto server may hold other tests' jobs
        assert starved["statusReason"].startswith("trnflow stopped the job: no trn1.32xlarge capacity after 0.05 min")
        assert not starved.get("attempts")  # it never started: nothing was billed
        (row,) = outcome.cost.rows
        assert row.jobs == 2 and row.instance_type == "trn1n.32xlarge"


def test_a_reclaimed_batch_spot_job_checkpoints_on_ec2s_notice_and_its_retry_ends_with_the_same_weights(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """A one-node spot spec on Batch runs as a single-node job on the spot queue. After the step-10
    checkpoint EC2 gives notice in the instance's metadata service (Batch tells the container nothing):
    training reads it at the next step boundary, checkpoints that step and exits as transient; the
    instance is then taken back, and Batch's retry runs on a new one and resumes from that step. The
    weights equal those of a job never reclaimed, and the job is billed at EC2's spot price."""
    import boto3
    import torch

    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import cloud_target, every_identity
    from trnflow.errors import ExitCode
    from trnflow.specs.instances import price
    from trnflow.workload.checkpoint import load

    reclaim = ServiceFault("batch", "train", "spot capacity reclaimed", when="checkpoint", spot=True)
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [reclaim],
                  compile_cache=warmed_cache) as (cloud, bucket):  # the reclaim is the subject, not compiling
        backend = BatchBackend(cloud_target(TrnflowSettings(), "batch"))
        spec = cloud_spec(make_spec, bucket, "batch", gate={"eval_every": None}, train={"steps": 30, "log_every": 1},
                           compute={"spot": True, "nodes": 1, "cores_per_node": 2},
                           registry_url=f"s3://{bucket}/registry-batch-spot")
        info = wait(backend, backend.submit(JobRequest(spec, "train", "bspot")), 0.5)
        assert info.state.value == "SUCCEEDED", info.failure
        assert 10 <= info.result.start_step < 30 and info.result.resumed_from
        batch = boto3.client("batch")
        (job,) = batch.describe_jobs(jobs=[info.job_id])["jobs"]
        assert job["jobQueue"].endswith("/trnflow-trn1-spot") and "nodeProperties" not in job
        first, last = job["attempts"]
        assert last["container"]["exitCode"] == 0
        assert first["container"]["exitCode"] == ExitCode.TRANSIENT  # SpotInterruption, retried by Batch's rule
        hosts = {n.attempt: n.instance_id for n in every_identity(backend.outputs(info.job_id))}
        assert hosts[1] != hosts[2] and hosts[1] in cloud.instances.started
        gone = boto3.client("ec2").describe_instances(InstanceIds=[hosts[1]])["Reservations"][0]["Instances"][0]
        assert gone["State"]["Name"] == "terminated"  # EC2 took it back; the retry ran elsewhere
        on_demand = price("ec2", "trn1.32xlarge").usd_per_hour
        assert info.details.spot and info.details.price_per_hour == pytest.approx(on_demand * 0.3, rel=1e-3)
        text, _ = backend.logs(info.job_id, 0)  # the retry's own stream: it resumed
        assert '"event": "resume"' in text, text[-2000:]

        whole = wait(backend, backend.submit(JobRequest(spec, "train", "bspot-whole")), 0.5)
        assert whole.state.value == "SUCCEEDED", whole.failure
        assert whole.result.start_step == 0
        ours, theirs = load(info.result.checkpoint).model, load(whole.result.checkpoint).model
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def _batch_backend():
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import cloud_target

    return BatchBackend(cloud_target(TrnflowSettings(), "batch"))


def test_a_fair_share_queue_refuses_a_job_without_a_share_identifier(
        moto_endpoint, tmp_path, monkeypatch, dataset, make_spec):
    """The deployment's queue has a fair-share policy: the service refuses a job without a share
    identifier there, and trnflow refuses to submit one, naming the field, before any job exists."""
    import boto3
    from botocore.exceptions import ClientError

    from trnflow.backends.batch_request import build_job_definition, build_submit_job
    from trnflow.errors import FatalError

    fault = ServiceFault("batch", "sanity", "Essential container in task exited", exit_code=1)
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault], in_process=True) as (cloud, bucket):
        batch, backend = boto3.client("batch"), _batch_backend()
        shared = cloud_spec(make_spec, bucket, "batch")
        plain = shared.model_copy(update={"compute": shared.compute.model_copy(
            update={"fair_share": None, "share_identifier": None})})
        with pytest.raises(FatalError) as caught:
            backend.submit(JobRequest(plain, "sanity", "unshared"))
        assert str(caught.value).startswith("compute.share_identifier: the job queue trnflow-trn1 has a fair-share "
                                            "scheduling policy (arn:aws:batch:")
        assert "set compute.share_identifier" in str(caught.value)
        assert batch.list_jobs(jobQueue="trnflow-trn1")["jobSummaryList"] == []
        assert batch.describe_job_definitions()["jobDefinitions"] == []  # refused before anything was registered

        role = "arn:aws:iam::123456789012:role/trnflow/trnflow-run-preflight-0123456789abcdef"
        definition = build_job_definition(plain, backend.target, "sanity", role)
        batch.register_job_definition(**definition)
        with pytest.raises(ClientError) as refused:  # sent anyway: the service refuses it as Batch does
            batch.submit_job(**build_submit_job(JobRequest(plain, "sanity", "raw"), backend.target,
                                                definition["jobDefinitionName"]))
        assert refused.value.response["Error"] == {"Code": "ClientException",
                                                   "Message": "shareIdentifier must be specified."}
        assert batch.list_jobs(jobQueue="trnflow-trn1")["jobSummaryList"] == []

        job = backend.submit(JobRequest(shared, "sanity", "shared"))
        cloud.wait_idle()
        assert [j["jobId"] for j in batch.list_jobs(jobQueue="trnflow-trn1")["jobSummaryList"]] == [job]


def test_the_batch_retry_strategy_and_fair_share_read_back_from_the_service(
        moto_endpoint, tmp_path, monkeypatch, dataset, make_spec):
    """The registered job definition keeps the retry strategy and the container's memory, and
    DescribeJobs tells the job's own strategy, share and priority, as Batch does."""
    import boto3

    from trnflow.backends.batch_request import build_job_definition, retry_strategy

    fault = ServiceFault("batch", "sanity", "Essential container in task exited", exit_code=1)
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault], in_process=True) as (cloud, bucket):
        batch, backend = boto3.client("batch"), _batch_backend()
        spec = cloud_spec(make_spec, bucket, "batch", compute={"scheduling_priority": 7, "memory_gib": 256})
        job = backend.submit(JobRequest(spec, "sanity", "strategy"))
        cloud.wait_idle()
        expected = retry_strategy(spec)
        assert expected["attempts"] == 3 and expected["evaluateOnExit"][-1] == {"action": "EXIT", "onReason": "*"}

        (described,) = batch.describe_jobs(jobs=[job])["jobs"]  # its definition: its own, naming its own role
        (definition,) = batch.describe_job_definitions(jobDefinitions=[described["jobDefinition"]])["jobDefinitions"]
        assert definition["jobDefinitionName"] == build_job_definition(spec, backend.target, "sanity", role=(
            definition["nodeProperties"]["nodeRangeProperties"][0]["container"]["jobRoleArn"]))["jobDefinitionName"]
        kept = definition["retryStrategy"]  # Batch reads `action` in any case (moto keeps it lower-case)
        assert {**kept, "evaluateOnExit": [{**r, "action": r["action"].upper()} for r in kept["evaluateOnExit"]]} \
            == expected
        container = definition["nodeProperties"]["nodeRangeProperties"][0]["container"]
        assert {"type": "MEMORY", "value": str(256 * 1024)} in container["resourceRequirements"]

        assert described["retryStrategy"] == expected
        assert (described["shareIdentifier"], described["schedulingPriority"]) == ("default", 7)
        assert len(described["attempts"]) == 1  # exit code 1 met the EXIT rule: not retried
        assert backend.describe(job).failure.type == "UserError"
        # ended: its role and its definition are gone
        (definition,) = batch.describe_job_definitions(jobDefinitions=[described["jobDefinition"]])["jobDefinitions"]
        assert definition["status"] == "INACTIVE"
        assert not boto3.client("iam").list_roles(PathPrefix="/trnflow/")["Roles"]
