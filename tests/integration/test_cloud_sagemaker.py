"""The SageMaker backend against moto, each training job run for real by MockCloud under SageMaker's
contract: the pipeline through capacity and internal errors, a host with bad memory, instance
preferences, managed spot and a job with no capacity anywhere."""



import pytest

from tests.clouds import (
    assert_artifacts_in_s3,
    cloud_spec,
    in_cloud,
)
from trnflow.backends import JobRequest, wait
from trnflow.flows.pipeline import STAGES, pipeline
from trnflow.reporting.forecast import plan
from trnflow.reporting.history import history
from trnflow.settings import TrnflowSettings
from trnflow.testing.mockcloud import ServiceFault
from trnflow.workload.memory import decided


@pytest.mark.slow
def test_the_pipeline_on_sagemaker_with_capacity_and_internal_errors(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """In-process moto. Preflight first meets a capacity error, which trnflow resubmits; the S3
    compile cache already holds every graph, so the compile stage launches no job; training loses
    its instance after a checkpoint, which SageMaker's own RetryStrategy retries within the job,
    and the retry resumes from the checkpoint. (The Batch test below compiles on the service.)"""
    import boto3

    faults = [ServiceFault("sagemaker", "sanity", "CapacityError: Unable to provision requested ML compute capacity"),
              ServiceFault("sagemaker", "train", "InternalServerError: We encountered an internal error.",
                           when="checkpoint")]
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, faults, in_process=True,
                compile_cache=warmed_cache) as (_, bucket):
        spec = cloud_spec(make_spec, bucket, "sagemaker")
        state = pipeline(spec, return_state=True)
        outcome = state.result(raise_on_failure=False)
        assert state.is_completed(), outcome
        outcome = outcome.model_dump(mode="json")
        assert [(r["stage"], r["state"]) for r in outcome["stages"]] == [(s, "Completed") for s in STAGES]
        results = outcome["results"]
        assert_artifacts_in_s3(spec, bucket, results)

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
def test_a_sagemaker_instance_with_bad_memory_is_replaced_by_a_resubmission(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
    """The first SageMaker instance has stuck memory bits: its preflight fails (BadHost), the job
    ends before training, and trnflow submits it again; the new job's instance passes the preflight
    and trains. SageMaker does not say which EC2 instance a job had: its host is named."""
    import boto3

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, host_faults={0: "memory@0"},
                  compile_cache=warmed_cache) as (cloud, bucket):
        spec = cloud_spec(make_spec, bucket, "sagemaker", compute={"cores_per_node": 1},  # one host: one rank will do
                          train={"steps": 20, "global_batch_size": 16}, gate={"eval_every": None},
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


def test_sagemaker_launches_the_first_preferred_instance_type_with_capacity_and_the_run_is_priced_by_it(
        prefect_api, make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    """No capacity for trn1.32xlarge: SageMaker takes the next of the spec's instance preferences, the
    stage records the type it got, and the cost table prices the job at that type's SageMaker price."""
    import boto3

    from trnflow.flows.preflight import preflight
    from trnflow.specs.instances import price

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, no_capacity={"trn1.32xlarge"}) as (_, bucket):
        spec = cloud_spec(make_spec, bucket, "sagemaker", compute={
            "instance_type": "trn1.32xlarge", "instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"],
            "cores_per_node": 1}, train={"global_batch_size": 16})  # which instance, not how many ranks
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


def test_a_reclaimed_sagemaker_spot_job_checkpoints_restarts_and_ends_with_the_uninterrupted_weights(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset, warmed_cache):
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
    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, [reclaim],
                  compile_cache=warmed_cache) as (_, bucket):  # the reclaim is the subject, not compiling
        backend = SageMakerBackend(cloud_target(TrnflowSettings(), "sagemaker"))
        spec = cloud_spec(make_spec, bucket, "sagemaker", compute={"spot": True}, gate={"eval_every": None},
                           train={"steps": 60, "log_every": 1})  # the notice strikes within 0.5 s of step 10
        info = wait(backend, backend.submit(JobRequest(spec, "train", "spot")), 0.5)
        assert info.state.value == "SUCCEEDED", info.failure
        resumed = info.result
        # the notice comes once the step-10 checkpoint is written: the restart resumes from the step
        # training had reached when it stopped (10 itself when the notice came before step 11 ended)
        assert 10 <= resumed.start_step < 60 and resumed.resumed_from
        job = boto3.client("sagemaker").describe_training_job(TrainingJobName=info.job_id)
        assert job["EnableManagedSpotTraining"] is True
        assert "Interrupted" in [t["Status"] for t in job["SecondaryStatusTransitions"]]
        assert job["BillableTimeInSeconds"] < job["TrainingTimeInSeconds"]

        whole = wait(backend, backend.submit(JobRequest(spec, "train", "never-reclaimed")), 0.5)
        assert whole.state.value == "SUCCEEDED", whole.failure
        ours, theirs = load(resumed.checkpoint).model, load(whole.result.checkpoint).model
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_sagemaker_job_with_no_capacity_for_any_of_its_types_fails_as_a_capacity_error(
        make_spec, moto_endpoint, tmp_path, monkeypatch, dataset):
    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.sagemaker import SageMakerBackend
    from trnflow.settings import TrnflowSettings

    with in_cloud(moto_endpoint, tmp_path, monkeypatch, dataset, no_capacity={"trn1.2xlarge"}) as (_, bucket):
        backend = SageMakerBackend(cloud_target(TrnflowSettings(), "sagemaker"))
        info = wait(backend, backend.submit(JobRequest(cloud_spec(make_spec, bucket, "sagemaker"), "sanity", "none")),
                    0.2)
        assert info.state.value == "FAILED"
        assert info.failure.type == "CapacityError" and info.failure.retryable is True
        assert "Unable to provision requested ML compute capacity" in info.failure.message
