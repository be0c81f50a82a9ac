"""The SageMaker and Batch backends against moto, with each submitted job run for real by MockCloud
under its service's contract: what each service's failures mean, who retries them, and the whole
pipeline on both services."""

import contextlib
import io
import json
import logging
import time

import pyarrow.parquet as pq
import pytest

from tests.conftest import ON_S3, quickstart_data
from trnflow.backends import JobRequest, wait
from trnflow.backends.service_status import batch_failure, sagemaker_failure, sagemaker_state
from trnflow.flows.pipeline import STAGES, pipeline
from trnflow.reporting.forecast import history, plan
from trnflow.results import FailureReport
from trnflow.settings import TrnflowSettings
from trnflow.testing.mockcloud import MockCloud, ServiceFault
from trnflow.testing.mockcloud.provision import SETTINGS, provision
from trnflow.workload.memory import decided

HOST_LOST = "Host EC2 (instance i-0d4c3b2a10f9e8d7c) terminated."


def _upload(s3, folder, bucket, prefix):
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


@contextlib.contextmanager
def _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, faults=(), in_process=False, compile_cache=None,
           node_faults=None, no_capacity=None, host_faults=None):
    """The emulated AWS with trnflow's deployment in it and the session's dataset uploaded (and a
    compile cache, when given, as the S3 cache). The client reaches it in-process (`mock_aws`) or
    through the moto server on 127.0.0.1; the job containers always reach it through the server,
    as containers reach AWS over the network."""
    import boto3
    from moto import mock_aws

    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    if in_process:  # the SDK's role check calls IAM's policy simulator, which moto lacks
        monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
        monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    with mock_aws() if in_process else contextlib.nullcontext():
        cloud = MockCloud(moto_endpoint, tmp_path / "cloud", faults=list(faults), node_faults=node_faults,
                          no_capacity=no_capacity, host_faults=host_faults)
        with cloud:
            outputs = provision(cloud.client)
            for name in SETTINGS:
                monkeypatch.setenv(f"TRNFLOW_{name}", outputs[name])
            _upload(boto3.client("s3"), dataset, outputs["DATA_BUCKET"], "reviews")
            if compile_cache is not None:
                _upload(boto3.client("s3"), compile_cache, outputs["DATA_BUCKET"], "neuron-cache")
            yield cloud, outputs["DATA_BUCKET"]


# A service fault `when="checkpoint"` strikes within half a second of the step-10 checkpoint, and
# the attempt's ranks die with its instances (the next checkpoint, at step 20, is seconds away).


def _cloud_spec(make_spec, bucket, backend, **sections):
    s3 = f"s3://{bucket}"
    compute = {"backend": backend, "instance_type": "trn1.2xlarge", "nodes": 1, "cores_per_node": 2}
    if backend == "batch":  # two trn1.32xlarge nodes, one core each: a real two-node rendezvous; the
        # deployment's queue has a fair-share policy, which refuses jobs without a share identifier
        compute |= {"instance_type": "trn1.32xlarge", "nodes": 2, "cores_per_node": 1, "fair_share": True,
                    "share_identifier": "default"}
    compute |= sections.pop("compute", {})
    return make_spec(
        data={"train": f"{s3}/reviews/train", "holdout": f"{s3}/reviews/holdout",
              "inference": f"{s3}/reviews/inference"},
        compute=compute, compile={"cache_url": f"{s3}/neuron-cache"},
        registry_url=sections.pop("registry_url", f"{s3}/registry"),
        train={"checkpoint_url": f"{s3}/checkpoints", "steps": 40, "checkpoint_every": 10} | sections.pop("train", {}),
        gate={"reference": "champion", "eval_every": 20} | sections.pop("gate", {}),
        inference={"output_url": f"{s3}/embeddings"},
        retries={"max_retries": 2, "backoff_seconds": 0.5}, **sections)


def _keys(s3, bucket, prefix):
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _assert_artifacts_in_s3(spec, bucket, results):
    import boto3

    s3 = boto3.client("s3")
    run = results["train"]["checkpoint"].rsplit("/", 2)[1]
    assert any(k.endswith("/COMMITTED") for k in _keys(s3, bucket, f"checkpoints/{run}/"))
    done = [k for k in _keys(s3, bucket, "neuron-cache/") if k.endswith("/model.done")]
    assert len(done) == 3  # the training, evaluation and embedding programs
    assert results["train"]["compile"]["recompiles"] == [] and results["train"]["compile"]["hits"] == 2, (
        results["train"]["compile"], results["train"]["start_step"])
    shards = [k for k in _keys(s3, bucket, "embeddings/") if k.endswith(".parquet")]
    assert shards and any(k.endswith("_manifest.json") for k in _keys(s3, bucket, "embeddings/"))
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=bucket, Key=shards[0])["Body"].read()))
    assert table.num_rows and "embedding" in table.column_names
    champion = [k for k in _keys(s3, bucket, "registry/") if "/champion/" in k]
    assert champion, "the gate passed, so the run was registered and promoted"


@pytest.mark.slow
def test_the_pipeline_on_sagemaker_with_capacity_and_internal_errors(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warm_compile_cache):
    """In-process moto. Preflight first meets a capacity error, which trnflow resubmits; the S3
    compile cache already holds every graph, so the compile stage launches no job; training loses
    its instance after a checkpoint, which SageMaker's own RetryStrategy retries within the job,
    and the retry resumes from the checkpoint. (The Batch test below compiles on the service.)"""
    import boto3

    faults = [ServiceFault("sagemaker", "sanity", "CapacityError: Unable to provision requested ML compute capacity"),
              ServiceFault("sagemaker", "train", "InternalServerError: We encountered an internal error.",
                           when="checkpoint")]
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, faults, in_process=True,
                compile_cache=warm_compile_cache) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, "sagemaker")
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        outcome = outcome.model_dump(mode="json")
        assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
        results = outcome["results"]
        _assert_artifacts_in_s3(spec, bucket, results)

        sm = boto3.client("sagemaker")
        jobs = sm_jobs = [sm.describe_training_job(TrainingJobName=j["TrainingJobName"])
                          for j in sm.list_training_jobs(MaxResults=100)["TrainingJobSummaries"]]
        phases = sorted(j["HyperParameters"]["phase"] for j in jobs)
        # the preflight and training ran in one job, on the same hosts; the capacity error cost one
        # resubmission, the internal error none (SageMaker retried it); evaluation ran inside the
        # training phase, the collectives inside the sanity phase, and a warm cache needs no compile job
        assert phases == ["infer", "sanity+train", "sanity+train"]
        assert results["collectives"]["phase"] == "sanity" and results["collectives"]["rows"]
        assert results["compile"]["launched"] is False and results["compile"]["hits"] == 3
        train = next(j for j in jobs if j["TrainingJobStatus"] == "Completed" and j["HyperParameters"]["phase"]
                     == "sanity+train")
        where = {stage: results[stage]["ran_on"] for stage in ("sanity", "collectives", "train")}
        assert all(w == where["train"] for w in where.values()), where
        assert where["train"]["job_id"] == train["TrainingJobName"] and where["train"]["hosts"] == ["algo-1"]
        assert "Restarting" in [t["Status"] for t in train["SecondaryStatusTransitions"]]
        assert results["train"]["start_step"] == 10  # the retry resumed from the checkpoint
        assert all(row["billable_seconds"] > 0 for row in outcome["cost"]["rows"])
        jobs = {row["stage"]: row["jobs"] for row in outcome["cost"]["rows"]}
        assert jobs == {"sanity": 1, "train": 1, "infer": 1}  # the job without capacity, then the one that trained
        # instances started: none for the job without capacity; the restart after the internal error launched anew
        started = {row["stage"]: row["instances_started"] for row in outcome["cost"]["rows"]}
        assert started == {"sanity": 0, "train": 2, "infer": 1}, outcome["cost"]
        assert outcome["cost"]["instances_started"] == 3 and outcome["cost"]["provisioning_seconds"] > 0
        # the run's measurements, kept beside its registry on S3, forecast the next run: provisioning and the
        # image pull the mock cloud models are in each stage's time, and forecast with it like the rest
        records, unread = history(spec, TrnflowSettings().home.expanduser().resolve())
        assert unread == [] and [r.layout.backend for r in records] == ["sagemaker"]
        waited = {row["stage"]: row["provisioning_seconds"] for row in outcome["cost"]["rows"]}
        infer = records[0].stage("infer")
        assert infer.seconds >= waited["infer"] > 0
        forecast = {s.stage: s for s in plan(decided(spec), records).stages}  # on the layout the run took
        assert forecast["infer"].source == "history" and forecast["infer"].seconds == round(infer.seconds, 1)
        # issue 54: each job ran as a role made for it (its run's write scope), deleted when it ended
        roles = [j["RoleArn"] for j in sm_jobs]
        assert len(set(roles)) == len(sm_jobs) and all(":role/trnflow/trnflow-run-" in r for r in roles), roles
        assert not boto3.client("iam").list_roles(PathPrefix="/trnflow/")["Roles"]


@pytest.mark.slow
def test_the_pipeline_on_batch_two_nodes_survives_a_lost_host(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Through the moto server on 127.0.0.1. Every stage is a two-node Batch job. Training loses a
    host after its step-10 checkpoint; Batch's retry strategy retries it and the retry resumes, then
    meets an execution timeout at step 25, which the container reports with exit code 75; Batch
    retries that too, and the third attempt resumes from step 20."""
    import boto3

    faults = [ServiceFault("batch", "train", HOST_LOST, when="checkpoint")]
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, faults) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, "batch", faults=[{"kind": "timeout", "core": 0, "step": 25}])
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        results = outcome.model_dump(mode="json")["results"]
        _assert_artifacts_in_s3(spec, bucket, results)

        batch = boto3.client("batch")
        queue = batch.list_jobs(jobQueue="trnflow-trn1", jobStatus="SUCCEEDED")["jobSummaryList"]
        described = batch.describe_jobs(jobs=[j["jobId"] for j in queue])["jobs"]
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
        # issue 54: each job ran as a role made for it, named in a definition of its own; both are gone
        definitions = batch.describe_job_definitions(jobDefinitions=[j["jobDefinition"] for j in described])
        roles = {d["nodeProperties"]["nodeRangeProperties"][0]["container"]["jobRoleArn"]
                 for d in definitions["jobDefinitions"]}
        assert len(roles) == len(described) and all(":role/trnflow/trnflow-run-" in r for r in roles), roles
        assert {d["status"] for d in definitions["jobDefinitions"]} == {"INACTIVE"}
        assert not boto3.client("iam").list_roles(PathPrefix="/trnflow/")["Roles"]


@pytest.mark.slow
@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_the_pipeline_with_sharded_training_on_each_cloud_backend(
        service, prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """train.parallelism.strategy fsdp over the two ranks of each service's job (two nodes of one
    core on Batch): the whole pipeline completes, training compiles nothing beyond what the compile
    stage cached, each rank held half of the state, and the registry gets the model whole."""
    from trnflow.lifecycle.registry import Registry
    from trnflow.workload.checkpoint import load

    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, service, train={"parallelism": {"strategy": "fsdp"}},
                           registry_url=f"s3://{bucket}/registry-fsdp-{service}")
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        train = outcome.results["train"]
        assert train.compile.recompiles == [] and train.compile.hits == train.compile.graphs > 0
        memory = train.device_memory
        assert memory["weights"] * 2 == pytest.approx(sum(p.numel() for p in load(train.checkpoint).model.values()) * 4,
                                                      rel=0.05)
        final = load(train.checkpoint)
        assert final.meta.parallelism == "fsdp" and sorted(final.shards)[1:] == ["__0_0.distcp", "__1_0.distcp"]
        champion = Registry(spec.registry_url).champion(spec.name)
        assert champion is not None and champion.checkpoint == train.checkpoint
        assert champion.entry.weights == f"{train.checkpoint}/model.pt"  # the model whole, beside its shards


def _our_batch_jobs(began: float) -> list[dict]:
    """The Batch jobs created since `began` (ms): the moto server is the session's, with earlier tests' jobs in it."""
    import boto3

    batch = boto3.client("batch")
    listed = [j["jobId"] for status in ("RUNNABLE", "STARTING", "RUNNING", "SUCCEEDED", "FAILED")
              for j in batch.list_jobs(jobQueue="trnflow-trn1", jobStatus=status)["jobSummaryList"]]
    return sorted((j for j in batch.describe_jobs(jobs=listed)["jobs"] if j["createdAt"] >= began),
                  key=lambda j: j["createdAt"])


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
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, node_faults={1: "corrupt@0"}) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, "batch")  # preflight.exclude_bad_cores is off
        state = pipeline(spec, run_id="a-bad-node", return_state=True)
        assert state.is_failed()
        stages = state.result(raise_on_failure=False).stages
        assert [(r.stage, r.state) for r in stages] == [("sanity", "Failed")]
        summary = stages[0].summary
        assert "NeuronCore(s) [0] failed known-answer tests" in summary and "is replaced" in summary, summary
        assert "nc0 of node 1 (" in summary and "AWS Batch retried" in summary  # the node, by its host name
        (job,) = _our_batch_jobs(began)
        assert job["tags"]["trnflow:phase"] == "sanity+train" and job["status"] == "FAILED"
        attempts = job["attempts"]
        assert len(attempts) == 1 + spec.retries.max_retries  # Batch retried it; trnflow did not resubmit
        assert all(a["container"].get("exitCode") == 79 for a in attempts), attempts
        (node1,) = boto3.client("batch").describe_jobs(jobs=[f"{job['jobId']}#1"])["jobs"]  # where Batch placed it
        placed = [a["container"]["containerInstanceArn"] for a in node1["attempts"]]
        assert len(placed) == len(set(placed)) == len(attempts)  # node 1 got a new instance for every retry
        assert not _keys(boto3.client("s3"), bucket, "checkpoints/a-bad-node/"), "nothing was trained"
        logs = "".join(p.read_text() for p in (tmp_path / "cloud").rglob("container.log"))
        assert '"event": "sanity"' in logs and '"event": "train"' not in logs


@pytest.mark.slow
def test_a_bad_core_is_excluded_inside_the_allocation_and_training_runs_on_the_cores_checked_again(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """preflight.exclude_bad_cores on a two-node Batch job whose node 1 has a corrupt nc0: the main
    node places node 1 on nc1 instead, both nodes check their cores again, and training runs on them,
    in the same job, on the same instances, in its first attempt."""
    import boto3

    began = time.time() * 1000
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, node_faults={1: "corrupt@0"}) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, "batch", train={"steps": 20}, gate={"eval_every": None},
                           preflight={"exclude_bad_cores": True}, registry_url=f"s3://{bucket}/registry-excluded")
        state = pipeline(spec, run_id="a-core-excluded", return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        sanity = outcome.results["sanity"]
        assert sanity.excluded_cores == [0] and "excluded bad core(s) [0]" in sanity.summary
        assert sorted((c["rank"], c["core"], c["passed"]) for c in sanity.per_core) == [(0, 0, True), (1, 1, True)]
        assert sanity.ran_on == outcome.results["train"].ran_on
        (job,) = [j for j in _our_batch_jobs(began) if j["tags"]["trnflow:phase"] == "sanity+train"]
        assert [a["container"].get("exitCode") for a in job["attempts"]] == [0]  # no instance was replaced
        staging = bucket.replace("-data-", "-staging-")  # where the job's nodes leave what they tell each other
        placed = [k for k in _keys(boto3.client("s3"), staging, "jobs/a-core-excluded/") if k.endswith(
            "phases/placement-1-1.json")]
        assert len(placed) == 1, "the main node chose other cores for node 1, once"
        main = (tmp_path / "cloud" / "batch" / job["jobId"] / "attempt-1" / "node-0" / "container.log").read_text()
        assert main.count("checking again without them (cores by node: {0: '0', 1: '1'})") == 1
        assert main.count('"event": "sanity", "rank": 0') == 2 and '"event": "train"' in main  # checked twice, trained
        assert outcome.results["train"].steps == 20


@pytest.mark.slow
def test_a_node_that_hangs_in_the_batch_preflight_is_replaced_and_training_runs_on_checked_instances(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """The instance serving node 1 of a two-node Batch job hangs in the preflight's first collective.
    Node 0 names the hang when the collective times out; the job exits 79 (BadHost); trnflow
    terminates the job's instances (which of the two hung, the other cannot tell); Batch's retry runs
    on new instances, whose preflight passes, and training runs on exactly those."""
    import boto3

    began = time.time() * 1000
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, host_faults={1: "hang@0"}) as (cloud, bucket):
        spec = _cloud_spec(make_spec, bucket, "batch", train={"steps": 20}, gate={"eval_every": None},
                           preflight={"collective_timeout_seconds": 10},
                           registry_url=f"s3://{bucket}/registry-hung-node")  # no other test's champion
        state = pipeline(spec, run_id="a-hung-node", return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        (hung,) = cloud.bad_hosts  # the EC2 instance that took the fault
        results = outcome.results
        sanity, collectives, train = (results[s].ran_on for s in ("sanity", "collectives", "train"))
        assert sanity == collectives == train and len(set(train.hosts)) == 2 and hung not in train.hosts
        (job,) = [j for j in _our_batch_jobs(began) if j["tags"]["trnflow:phase"] == "sanity+train"]
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
def test_a_sagemaker_instance_with_bad_memory_is_replaced_by_a_resubmission(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """The first SageMaker instance has stuck memory bits: its preflight fails (BadHost), the job
    ends before training, and trnflow submits it again; the new job's instance passes the preflight
    and trains. SageMaker does not say which EC2 instance a job had: its host is named."""
    import boto3

    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, host_faults={0: "memory@0"}) as (cloud, bucket):
        spec = _cloud_spec(make_spec, bucket, "sagemaker", train={"steps": 20}, gate={"eval_every": None},
                           registry_url=f"s3://{bucket}/registry-bad-memory")  # no other test's champion
        state = pipeline(spec, run_id="bad-memory", return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        (bad,) = cloud.bad_hosts
        sm = boto3.client("sagemaker")
        jobs = [sm.describe_training_job(TrainingJobName=j["TrainingJobName"])
                for j in sm.list_training_jobs(MaxResults=100)["TrainingJobSummaries"]]
        ours = sorted((j for j in jobs if j["HyperParameters"].get("run-id") == "bad-memory"),
                      key=lambda j: j["CreationTime"])
        chained = [j for j in ours if j["HyperParameters"]["phase"] == "sanity+train"]
        assert [j["TrainingJobStatus"] for j in chained] == ["Failed", "Completed"]
        assert bad == f"{chained[0]['TrainingJobName']}/algo-1"
        assert '"type":"BadHost"' in chained[0]["FailureReason"].replace(" ", "")
        assert "memory" in chained[0]["FailureReason"]
        train = outcome.results["train"].ran_on
        assert train.job_id == chained[1]["TrainingJobName"] == outcome.results["sanity"].ran_on.job_id


@pytest.mark.parametrize("service", ["sagemaker", "batch"])
def test_a_user_error_fails_the_stage_once_and_is_never_retried(
        service, prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    import boto3

    report = json.dumps({"type": "DataError", "retryable": False, "message": "data.train has no rows"})
    fault = (ServiceFault("sagemaker", "sanity", f"AlgorithmError: {report}") if service == "sagemaker" else
             ServiceFault("batch", "sanity", "Essential container in task exited", exit_code=1))
    began = time.time() * 1000  # the moto server is the session's: earlier tests' jobs are in it too
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault]) as (_, bucket):
        state = pipeline(_cloud_spec(make_spec, bucket, service), return_state=True)
        assert state.is_failed()
        message = str(state.result(raise_on_failure=False))
        if service == "sagemaker":
            assert "DataError" in message and "data.train has no rows" in message
            jobs = boto3.client("sagemaker").list_training_jobs(MaxResults=100)["TrainingJobSummaries"]
            assert len([j for j in jobs if j["CreationTime"].timestamp() * 1000 >= began - 1000]) == 1
        else:
            assert "exit code 1" in message
            jobs = [j for j in boto3.client("batch").list_jobs(jobQueue="trnflow-trn1", jobStatus="FAILED")[
                "jobSummaryList"] if j["createdAt"] >= began]
            assert len(jobs) == 1
            (job,) = boto3.client("batch").describe_jobs(jobs=[jobs[0]["jobId"]])["jobs"]
            assert len(job["attempts"]) == 1  # the EXIT rule: Batch did not retry it either


def test_sagemaker_launches_the_first_preferred_instance_type_with_capacity_and_the_run_is_priced_by_it(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """No capacity for trn1.32xlarge: SageMaker takes the next of the spec's instance preferences, the
    stage records the type it got, and the cost table prices the job at that type's SageMaker price."""
    import boto3

    from trnflow.flows.preflight import preflight
    from trnflow.specs.instances import price

    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, no_capacity={"trn1.32xlarge"}) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, "sagemaker", compute={
            "instance_type": "trn1.32xlarge", "instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"]})
        outcome = preflight(spec, run_id="preferred")
        sanity = outcome.results["sanity"]
        assert sanity.ran_on.backend == "sagemaker" and sanity.ran_on.instance_type == "trn1n.32xlarge"
        assert sanity.ran_on.hosts == ["algo-1"]
        job = boto3.client("sagemaker").describe_training_job(TrainingJobName=sanity.ran_on.job_id)
        assert job["ResourceConfig"]["SelectedInstanceType"] == "ml.trn1n.32xlarge"
        assert job["StoppingCondition"]["MaxPendingTimeInSeconds"] == 3600
        (row,) = outcome.cost.rows
        assert row.instance_type == "trn1n.32xlarge"
        assert row.price_per_node_hour == price("sagemaker", "trn1n.32xlarge").usd_per_hour


def test_a_batch_job_left_runnable_for_lack_of_capacity_is_cancelled_and_the_next_instance_type_runs_it(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Batch leaves a job for trn1.32xlarge RUNNABLE while it has none. After compute.max_pending_minutes
    trnflow cancels it, naming the queue and the instance type, and submits the job again for the next
    of compute.instance_preferences; the stage records the type it got."""
    import boto3

    from trnflow.flows.preflight import preflight

    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, no_capacity={"trn1.32xlarge"}) as (_, bucket):
        spec = _cloud_spec(make_spec, bucket, "batch", compute={
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


def test_a_reclaimed_sagemaker_spot_job_checkpoints_restarts_and_ends_with_the_uninterrupted_weights(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Managed spot training: after the step-10 checkpoint the instance is reclaimed. Its containers
    get SIGTERM, training checkpoints the step it reached and ends; SageMaker marks the job
    Interrupted and restarts it, which resumes from that step. The job completes with the weights
    of a job that was never interrupted, and bills less than it ran."""
    import boto3
    import torch

    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend
    from trnflow.settings import TrnflowSettings
    from trnflow.workload.checkpoint import load

    reclaim = ServiceFault("sagemaker", "train", "spot capacity reclaimed", when="checkpoint", spot=True)
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [reclaim]) as (_, bucket):
        backend = SageMakerBackend(cloud_target(TrnflowSettings(), "sagemaker"))
        spec = _cloud_spec(make_spec, bucket, "sagemaker", compute={"spot": True}, gate={"eval_every": None},
                           train={"steps": 30, "log_every": 1})
        info = wait(backend, backend.submit(JobRequest(spec, "train", "spot")), 0.5)
        assert info.state.value == "SUCCEEDED", info.failure
        resumed = info.result
        # the notice comes once the step-10 checkpoint is written: the restart resumes from the step
        # training had reached when it stopped (10 itself when the notice came before step 11 ended)
        assert 10 <= resumed.start_step < 30 and resumed.resumed_from
        job = boto3.client("sagemaker").describe_training_job(TrainingJobName=info.job_id)
        assert job["EnableManagedSpotTraining"] is True
        assert "Interrupted" in [t["Status"] for t in job["SecondaryStatusTransitions"]]
        assert job["BillableTimeInSeconds"] < job["TrainingTimeInSeconds"]

        whole = wait(backend, backend.submit(JobRequest(spec, "train", "never-reclaimed")), 0.5)
        assert whole.state.value == "SUCCEEDED", whole.failure
        ours, theirs = load(resumed.checkpoint).model, load(whole.result.checkpoint).model
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_reclaimed_batch_spot_job_checkpoints_on_ec2s_notice_and_its_retry_ends_with_the_same_weights(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
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
    from trnflow.settings import TrnflowSettings
    from trnflow.specs.instances import price
    from trnflow.workload.checkpoint import load

    reclaim = ServiceFault("batch", "train", "spot capacity reclaimed", when="checkpoint", spot=True)
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [reclaim]) as (cloud, bucket):
        backend = BatchBackend(cloud_target(TrnflowSettings(), "batch"))
        spec = _cloud_spec(make_spec, bucket, "batch", gate={"eval_every": None}, train={"steps": 30, "log_every": 1},
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


def test_a_sagemaker_job_with_no_capacity_for_any_of_its_types_fails_as_a_capacity_error(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend
    from trnflow.settings import TrnflowSettings

    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, no_capacity={"trn1.2xlarge"}) as (_, bucket):
        backend = SageMakerBackend(cloud_target(TrnflowSettings(), "sagemaker"))
        info = wait(backend, backend.submit(JobRequest(_cloud_spec(make_spec, bucket, "sagemaker"), "sanity", "none")),
                    0.2)
        assert info.state.value == "FAILED"
        assert info.failure.type == "CapacityError" and info.failure.retryable is True
        assert "Unable to provision requested ML compute capacity" in info.failure.message


@pytest.mark.parametrize("service", ["batch", "sagemaker"])
def test_a_job_whose_other_node_failed_while_the_main_node_stalls_is_stopped(
        service, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """Node 0's rank stops making progress at step 3 (its host stopped answering); node 1's rank
    times out in the step's all-reduce and its container fails. Neither service ends a job before its
    main node does, and the main node would sleep until the attempt's timeout. The backend, which
    watches every node, stops the job with node 1's transient failure, so the stage is resubmitted."""
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import STOPPED_BY_TRNFLOW, NodeWatch, cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend
    from trnflow.settings import TrnflowSettings

    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, node_faults={0: "stall@0:train:3"}) as (cloud, bucket):
        spec = _cloud_spec(make_spec, bucket, service, preflight={"collective_timeout_seconds": 5},
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


def test_throttling_while_polling_is_retried_without_failing(moto_endpoint, tmp_path, monkeypatch, dataset,
                                                             make_spec, caplog):
    from botocore.awsrequest import AWSResponse

    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend
    from trnflow.settings import TrnflowSettings

    fault = ServiceFault("sagemaker", "train", "AlgorithmError: bad input")
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault]) as (cloud, bucket):
        backend = SageMakerBackend(cloud_target(TrnflowSettings(), "sagemaker"))
        job = backend.submit(JobRequest(_cloud_spec(make_spec, bucket, "sagemaker"), "train", "throttled"))
        cloud.wait_idle()
        throttles = iter(range(2))

        def throttle(**_):
            if next(throttles, None) is not None:
                error = {"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"},
                         "ResponseMetadata": {"HTTPStatusCode": 400}}
                return AWSResponse("http://sagemaker", 400, {}, None), error
            return None

        backend._sm.meta.events.register("before-call.sagemaker.DescribeTrainingJob", throttle)
        monkeypatch.setattr("trnflow.aws.FIRST_WAIT_SECONDS", 0.01)
        with caplog.at_level(logging.WARNING, logger="trnflow.aws"):
            info = backend.describe(job)
        assert info.state.value == "FAILED" and info.failure.type == "UserError"
        assert len([r for r in caplog.records if "ThrottlingException" in r.getMessage()]) == 2


def _batch_backend():
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import cloud_target
    from trnflow.settings import TrnflowSettings

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
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault], in_process=True) as (cloud, bucket):
        batch, backend = boto3.client("batch"), _batch_backend()
        shared = _cloud_spec(make_spec, bucket, "batch")
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
    with _cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [fault], in_process=True) as (cloud, bucket):
        batch, backend = boto3.client("batch"), _batch_backend()
        spec = _cloud_spec(make_spec, bucket, "batch", compute={"scheduling_priority": 7, "memory_gib": 256})
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


def test_each_service_failure_maps_to_its_error_class_and_retry_owner():
    def sm(reason, secondary="Failed"):
        return sagemaker_failure({"TrainingJobName": "j", "FailureReason": reason, "SecondaryStatus": secondary,
                                  "StoppingCondition": {"MaxRuntimeInSeconds": 60}})

    assert sm("CapacityError: Unable to provision").type == "CapacityError"  # trnflow resubmits
    assert sm("CapacityError: Unable to provision").retryable
    assert sm("InternalServerError: oops").type == "InternalServiceError"  # SageMaker retried it already
    transient = sm('AlgorithmError: {"type": "ExecutionTimeout", "retryable": true, "message": "nc3"}')
    assert transient.type == "ExecutionTimeout" and transient.retryable  # a device fault: resubmitted
    assert sm("AlgorithmError: Traceback ...").type == "UserError"
    assert sm("", secondary="MaxRuntimeExceeded").type == "JobTimeout"
    spot = sm("", secondary="MaxWaitTimeExceeded")
    assert spot.type == "CapacityError" and spot.retryable and "compute.max_wait_hours" in spot.message
    pending = {"TrainingJobName": "j", "TrainingJobStatus": "Stopped", "SecondaryStatus": "Stopped",
               "StoppingCondition": {"MaxPendingTimeInSeconds": 1800},
               "SecondaryStatusTransitions": [{"Status": "Starting"}, {"Status": "Stopped"}]}
    assert sagemaker_state(pending).value == "FAILED"  # SageMaker stopped it waiting for capacity
    assert sagemaker_failure(pending).type == "CapacityError" and sagemaker_failure(pending).retryable
    trained = {**pending, "SecondaryStatusTransitions": [{"Status": "Training"}, {"Status": "Stopped"}]}
    assert sagemaker_state(trained).value == "CANCELLED"  # stopped by a person once it ran

    from trnflow.backends.batch_request import retry_strategy

    rules = retry_strategy(_spec_for_rules())["evaluateOnExit"]

    def batch(code, status_reason, report=None, reason=""):
        return batch_failure({"jobId": "id", "jobName": "n", "attempts": [
            {"container": {"exitCode": code, "reason": reason}, "statusReason": status_reason}] * 3}, rules, report)

    host = batch(None, HOST_LOST)
    assert host.type == "HostFailure" and not host.retryable and "retried n (id) 3 time(s)" in host.message
    assert batch(75, "Essential container in task exited").type == "HostFailure"  # exit 75: Batch's to retry
    assert batch(79, "Essential container in task exited").type == "HostFailure"  # a bad host: Batch's too
    agent = batch(None, "Essential container in task exited", reason="AGENT")  # no rule left for it: trnflow's
    assert agent.type == "AgentLost" and agent.retryable
    user = batch(1, "Essential container in task exited")
    assert user.type == "UserError" and "exit code 1" in user.message
    named = batch(1, "Essential container in task exited", FailureReport(type="GateFailed", message="outside the band"))
    assert named.type == "GateFailed" and not named.retryable


def _spec_for_rules():
    from trnflow.specs import validate_spec

    return validate_spec(quickstart_data(compute={"backend": "batch", "instance_type": "trn1.32xlarge"},
                                         train={"checkpoint_url": "s3://acme-data/ckpt"}, **ON_S3))


def test_the_log_reader_returns_only_new_lines_and_continues_from_its_page_token(in_process_aws):
    import boto3

    from trnflow.backends.cloudwatch import StreamReader

    logs = boto3.client("logs")
    logs.create_log_group(logGroupName="/g")
    logs.create_log_stream(logGroupName="/g", logStreamName="s")

    def put(*lines):
        logs.put_log_events(logGroupName="/g", logStreamName="s",
                            logEvents=[{"timestamp": int(time.time() * 1000), "message": m} for m in lines])

    reader, calls = StreamReader(logs, "/g"), []
    logs.meta.events.register("provide-client-params.logs.GetLogEvents",
                              lambda params, **_: calls.append(dict(params)))
    assert reader.read("s", 0) == ("", 0)
    put("one", "two")
    text, cursor = reader.read("s", 0)
    assert (text, cursor) == ("one\ntwo\n", 2)
    put("three")
    assert reader.read("s", cursor) == ("three\n", 3)
    assert "nextToken" in calls[-1] or "nextToken" in calls[-2]  # it did not start from the head again
    assert StreamReader(logs, "/g").read("s", 2) == ("three\n", 3)  # a new reader skips what was read
