"""The SageMaker and Batch requests, built by pure functions and checked whole, and the container's
reading of each service's contract."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ON_S3, quickstart_data
from trnflow.backends import JobRequest
from trnflow.backends.batch_request import build_job_definition, build_submit_job, exit_action, queue_problems
from trnflow.backends.cloud import BASE_NAME_LENGTH, CloudTarget, container_environment, job_name
from trnflow.backends.container import batch_rendezvous, sagemaker_rendezvous, torchrun_argv
from trnflow.backends.sagemaker_request import build_training_job_request
from trnflow.errors import FatalError
from trnflow.settings import JOB_KINDS, STAGE_KINDS, TrnflowSettings
from trnflow.specs import SpecError, load_spec, validate_spec
from trnflow.teams import UNDECLARED, Team

TARGET = CloudTarget(image="123456789012.dkr.ecr.us-east-1.amazonaws.com/trnflow:0.1.0",
                     staging_url="s3://acme-staging/trnflow", role_arn="arn:aws:iam::123456789012:role/trnflow-sm",
                     job_queue="trn1-fair-share")


def _spec(itype="trn1n.32xlarge", nodes=2, cores=32, **sections):
    return validate_spec(quickstart_data(
        name="embed",
        data={"train": "s3://acme-data/reviews/train", "holdout": "s3://acme-data/reviews/holdout",
              "inference": "s3://acme-data/reviews/catalogue", "format": "parquet"},
        compute={"backend": "sagemaker", "instance_type": itype, "nodes": nodes, "cores_per_node": cores,
                 "precision": "bf16-sr", "max_runtime_hours": 6, **sections.pop("compute", {})},
        compile={"optlevel": 1, "cache_url": "s3://acme-cache/neuron"},
        train={"steps": 100, "global_batch_size": 64 * nodes * cores // 32, "checkpoint_url": "s3://acme-ckpt/embed",
               **sections.pop("train", {})},
        retries={"max_retries": 3},
        inference={"output_url": "s3://acme-out/embed"},
        **sections,
    ))


def test_the_sagemaker_request_for_a_training_stage_whole():
    request = JobRequest(_spec(), "train", "20261123-run")
    env = {"NEURON_CC_FLAGS": "--optlevel=1 --cache_dir=s3://acme-cache/neuron",
           "NEURON_COMPILE_CACHE_URL": "s3://acme-cache/neuron", "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1",
           "TRNFLOW_PHASE": "train", "TRNFLOW_RUN_ID": "20261123-run",
           "TRNFLOW_SPEC_URL": "s3://acme-staging/trnflow/20261123-run/embed-train-20261123-run/input/spec.json",
           "TRNFLOW_NPROC_PER_NODE": "32", "TRNFLOW_CHECKPOINT_S3_URI": "s3://acme-ckpt/embed/20261123-run",
           "TRNFLOW_RESULT_URL": "s3://acme-staging/trnflow/20261123-run/embed-train-20261123-run/output",
           # trn1n: SageMaker sets these only for trn1.32xlarge, so trnflow does
           "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "RDMAV_FORK_SAFE": "1"}

    def channel(name, uri, mode="FastFile"):
        return {"ChannelName": name, "InputMode": mode, "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}

    assert build_training_job_request(request, TARGET) == {
        "TrainingJobName": "embed-train-20261123-run",
        "RoleArn": TARGET.role_arn,
        # the image's entrypoint is `python -m trnflow.backends.container`; SageMaker adds `train`
        "AlgorithmSpecification": {"TrainingImage": TARGET.image, "TrainingInputMode": "File"},
        "HyperParameters": {"phase": "train", "run-id": "20261123-run"},
        "ResourceConfig": {"InstanceType": "ml.trn1n.32xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200},
        # a job that waits longer than compute.max_pending_minutes for capacity is stopped
        "StoppingCondition": {"MaxRuntimeInSeconds": 6 * 3600, "MaxPendingTimeInSeconds": 3600},
        "CheckpointConfig": {"S3Uri": "s3://acme-ckpt/embed/20261123-run", "LocalPath": "/opt/ml/checkpoints"},
        "RetryStrategy": {"MaximumRetryAttempts": 3},
        "InputDataConfig": [
            channel("spec", "s3://acme-staging/trnflow/20261123-run/embed-train-20261123-run/input", mode="File"),
            channel("train", "s3://acme-data/reviews/train"), channel("holdout", "s3://acme-data/reviews/holdout")],
        "OutputDataConfig": {"S3OutputPath": "s3://acme-staging/trnflow/20261123-run/output"},
        "Environment": env,
        "Tags": [{"Key": "trnflow:job", "Value": "embed"}, {"Key": "trnflow:phase", "Value": "train"},
                 {"Key": "trnflow:run-id", "Value": "20261123-run"},
                 {"Key": "trnflow:spec-digest", "Value": request.spec.digest()},
                 {"Key": "trnflow-team", "Value": "default"}],  # its team's orchestrator alone may stop it
    }


def _valid_for_the_service(service: str, operation: str, params: dict) -> None:
    """Refused as botocore refuses a request the service's model does not allow."""
    import botocore.session
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model(service).operation_model(operation)
    report = ParamValidator().validate(params, model.input_shape)
    assert not report.has_errors(), report.generate_report()


def test_no_two_runs_share_a_job_name_and_so_a_set_of_log_streams_whatever_their_names_or_teams():
    name = "search-ranking-embeddings-multilingual-v2"
    spec = validate_spec({**_spec().model_dump(mode="json"), "name": name})
    first, second = (JobRequest(spec, "train", run) for run in ("20261206T010000-0123abcd", "20261206T010000-0123abce"))
    for limit in (BASE_NAME_LENGTH, 63):  # a long model name cuts the run ids away
        names = job_name(first, UNDECLARED, limit), job_name(second, UNDECLARED, limit)
        assert names[0] != names[1] and all(len(n) <= limit and n.startswith("search-ranking") for n in names)
        assert job_name(first, UNDECLARED, limit) == names[0]  # the same job, the same name: its staging is found again
    short = JobRequest(spec, "train", "r9")
    assert job_name(short, UNDECLARED, 128) == f"{name}-train-r9"  # one that fits is kept whole
    # two teams' run ids are their own: the same model name and run id are two jobs, two names
    search, ads = (Team(name=t, checkpoints=f"s3://c/{t}", registry=f"s3://c/r/{t}", outputs=f"s3://o/{t}",
                        cache=f"s3://k/{t}") for t in ("search", "ads"))
    assert len({job_name(short, team, BASE_NAME_LENGTH) for team in (UNDECLARED, search, ads)}) == 3
    assert job_name(short, search, BASE_NAME_LENGTH).startswith(f"{name}-train-r9"[:BASE_NAME_LENGTH - 17])
    assert build_training_job_request(first, TARGET)["TrainingJobName"] == job_name(first, UNDECLARED,
                                                                                    BASE_NAME_LENGTH)


def test_capacity_settings_become_sagemakers_instance_preferences_pending_limit_and_training_plan():
    wanted = _spec(itype="trn1.32xlarge", compute={"instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"],
                                                    "max_pending_minutes": 45})
    body = build_training_job_request(JobRequest(wanted, "train", "r1"), TARGET)
    assert body["ResourceConfig"] == {"InstanceCount": 2, "VolumeSizeInGB": 200, "InstancePreferences": [
        {"InstanceType": "ml.trn1.32xlarge"}, {"InstanceType": "ml.trn1n.32xlarge"}]}  # never with InstanceType
    assert body["StoppingCondition"] == {"MaxRuntimeInSeconds": 6 * 3600, "MaxPendingTimeInSeconds": 45 * 60}
    _valid_for_the_service("sagemaker", "CreateTrainingJob", body)

    plan = "arn:aws:sagemaker:us-east-1:123456789012:training-plan/reserved-trn1"
    planned = build_training_job_request(JobRequest(_spec(compute={"training_plan": plan}), "train", "r2"), TARGET)
    assert planned["ResourceConfig"]["TrainingPlanArn"] == plan
    _valid_for_the_service("sagemaker", "CreateTrainingJob", planned)


def test_spot_becomes_managed_spot_training_with_a_wait_of_at_least_the_runtime():
    body = build_training_job_request(JobRequest(_spec(compute={"spot": True}), "train", "r3"), TARGET)
    assert body["EnableManagedSpotTraining"] is True
    assert body["Environment"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "100"  # the ranks' time to checkpoint
    assert body["StoppingCondition"]["MaxWaitTimeInSeconds"] == 2 * 6 * 3600  # twice the runtime, by default
    assert "MaxPendingTimeInSeconds" not in body["StoppingCondition"]  # a spot job's waits: MaxWaitTimeInSeconds
    _valid_for_the_service("sagemaker", "CreateTrainingJob", body)
    waited = build_training_job_request(JobRequest(_spec(compute={"spot": True, "max_wait_hours": 7}), "train", "r4"),
                                        TARGET)
    assert waited["StoppingCondition"]["MaxWaitTimeInSeconds"] == 7 * 3600
    assert "EnableManagedSpotTraining" not in build_training_job_request(JobRequest(_spec(), "train", "r5"), TARGET)


@pytest.mark.parametrize(("compute", "problem"), [
    ({"instance_type": "trn1.2xlarge", "instance_preferences": ["trn1.32xlarge"]},
     "compute.instance_type: trn1.2xlarge is not the first of compute.instance_preferences (trn1.32xlarge)"),
    ({"instance_type": "trn1.32xlarge", "instance_preferences": ["trn1.32xlarge", "trn2.48xlarge"]},
     "mix trn1 with trn2, which run different training images"),
    ({"instance_type": "trn1.32xlarge", "instance_preferences": ["trn1.32xlarge", "trn1.2xlarge"]},
     "compute.cores_per_node: trn1.2xlarge (compute.instance_preferences lists it) has 2 NeuronCores; set "
     "compute.cores_per_node <= 2, or remove trn1.2xlarge from compute.instance_preferences"),
    ({"instance_type": "trn1.32xlarge", "instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"],
      "training_plan": "arn:aws:sagemaker:us-east-1:123456789012:training-plan/p"},
     "compute.training_plan: a training plan reserves one instance type"),
    ({"backend": "batch", "training_plan": "arn:aws:sagemaker:us-east-1:123456789012:training-plan/p"},
     "compute.training_plan: training plans are SageMaker's, and compute.backend is batch"),
    ({"spot": True, "max_wait_hours": 5}, "compute.max_wait_hours: 5 is less than compute.max_runtime_hours (6)"),
    ({"max_wait_hours": 12}, "compute.max_wait_hours: it bounds a spot job's waits"),
    ({"spot": True, "instance_type": "trn1.32xlarge", "instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"]},
     "compute.spot: SageMaker's instance preferences take on-demand capacity only"),
    ({"spot": True, "backend": "batch", "instance_type": "trn1.32xlarge"},
     "compute.spot: AWS Batch does not run multi-node parallel jobs on spot "
     "compute environments, and this spec asks for 2 nodes; set compute.nodes: 1"),
    ({"spot": True, "backend": "batch", "nodes": 1, "instance_type": "trn1n.32xlarge"},
     "compute.instance_type: Batch spot jobs run on the deployment's spot compute environment, which holds "
     "trn1.32xlarge"),
    ({"spot": True, "backend": "batch", "nodes": 1, "instance_type": "trn1.32xlarge", "max_wait_hours": 12},
     "compute.max_wait_hours: it is SageMaker's MaxWaitTimeInSeconds; on Batch each wait for spot capacity"),
])
def test_every_instance_a_job_may_get_is_checked_up_front(compute, problem):
    with pytest.raises(SpecError) as refused:
        _spec(compute=compute)
    assert problem in str(refused.value)


def test_an_unset_instance_type_is_the_first_preference():
    data = quickstart_data(compute={"instance_preferences": ["trn1n.32xlarge", "trn1.32xlarge"], "cores_per_node": 32})
    del data["compute"]["instance_type"]
    assert validate_spec(data).compute.instance_type == "trn1n.32xlarge"


def test_an_inference_stage_gets_its_checkpoint_and_the_inference_channel_only():
    request = JobRequest(_spec(itype="trn1.2xlarge", nodes=1, cores=2), "infer", "r1",
                         checkpoint="s3://acme-ckpt/embed/r1/step-000100")
    built = build_training_job_request(request, TARGET)
    assert [c["ChannelName"] for c in built["InputDataConfig"]] == ["spec", "inference"]
    assert built["HyperParameters"]["checkpoint"] == "s3://acme-ckpt/embed/r1/step-000100"
    assert built["Environment"]["TRNFLOW_CHECKPOINT"] == "s3://acme-ckpt/embed/r1/step-000100"
    assert not any(k.startswith("FI_") for k in built["Environment"])  # no EFA on trn1.2xlarge


def test_local_data_cannot_become_a_sagemaker_channel():
    """Validation refuses it; a spec changed since (`model_copy` does not validate) is refused again."""
    spec = _spec()
    changed = spec.model_copy(update={"data": spec.data.model_copy(update={"train": "file:///data/train"})})
    with pytest.raises(FatalError, match=r"data\.train: .* is not on S3"):
        build_training_job_request(JobRequest(changed, "train", "r"), TARGET)


@pytest.mark.parametrize("url", ["runs/checkpoints", "/var/ckpt", "file:///var/ckpt"])
def test_a_sagemaker_spec_with_checkpoints_off_s3_is_refused_at_validation(url):
    with pytest.raises(SpecError) as caught:
        validate_spec(quickstart_data(compute={"backend": "sagemaker"}, train={"checkpoint_url": url}), "s.yaml")
    (problem,) = [p for p in caught.value.problems if p.startswith("train.checkpoint_url")]
    assert problem.startswith("train.checkpoint_url: file:///") and "is not on S3" in problem
    assert "CheckpointConfig.S3Uri" in problem and "set train.checkpoint_url to s3://<bucket>/<prefix>" in problem
    # the same checkpoints are fine where they are written by this machine
    assert validate_spec(quickstart_data(train={"checkpoint_url": url})).compute.backend == "local"


def test_switching_a_spec_with_local_checkpoints_to_sagemaker_is_refused(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(quickstart_data(train={"checkpoint_url": str(tmp_path / "ckpt")})))
    with pytest.raises(SpecError, match=r"train\.checkpoint_url: file://.* is not on S3"):
        load_spec(path, {"compute.backend": "sagemaker"})  # as `trnflow run --backend sagemaker` does


def test_the_sagemaker_request_never_carries_a_checkpoint_uri_off_s3():
    """A spec changed after validation (`model_copy` does not validate) is refused by the builder."""
    spec = _spec(itype="trn1.2xlarge", nodes=1, cores=2)
    local = spec.model_copy(update={"train": spec.train.model_copy(update={"checkpoint_url": "file:///var/ckpt"})})
    with pytest.raises(FatalError, match=r"train\.checkpoint_url: file:///var/ckpt is not on S3"):
        build_training_job_request(JobRequest(local, "train", "r1"), TARGET)
    built = build_training_job_request(JobRequest(spec, "train", "r1"), TARGET)
    assert built["CheckpointConfig"]["S3Uri"] == "s3://acme-ckpt/embed/r1"
    # the kinds whose role may not write the run's checkpoints do not have SageMaker sync them
    assert "CheckpointConfig" not in build_training_job_request(JobRequest(spec, "infer", "r1"), TARGET)
    assert "CheckpointConfig" not in build_training_job_request(JobRequest(spec, "compile", "r1"), TARGET)


def test_the_batch_job_definition_whole_and_named_by_its_content():
    spec = _spec(itype="trn1.32xlarge", nodes=4, compute={"share_identifier": "search", "scheduling_priority": 7})
    definition = build_job_definition(spec, TARGET)
    container = definition["nodeProperties"]["nodeRangeProperties"][0]["container"]
    devices = [d["hostPath"] for d in container["linuxParameters"]["devices"]]
    assert devices == [f"/dev/neuron{i}" for i in range(16)] + [f"/dev/infiniband/uverbs{i}" for i in range(8)]
    assert definition["type"] == "multinode"
    assert definition["nodeProperties"] == {
        "numNodes": 4, "mainNode": 0, "nodeRangeProperties": [{"targetNodes": "0:", "container": container}]}
    assert container["command"] == ["batch"]  # after the image's entrypoint, python -m trnflow.backends.container
    assert container["instanceType"] == "trn1.32xlarge" and container["image"] == TARGET.image
    assert container["ulimits"] == [{"name": "memlock", "softLimit": -1, "hardLimit": -1}]
    assert container["resourceRequirements"] == [{"type": "VCPU", "value": "96"},
                                                 {"type": "MEMORY", "value": str(512 * 1024 - 12 * 1024)}]
    rules = definition["retryStrategy"]["evaluateOnExit"]
    assert definition["retryStrategy"]["attempts"] == 4 and len(rules) <= 5
    assert {"action": "RETRY", "onStatusReason": "Host EC2*"} in rules
    assert {"action": "RETRY", "onExitCode": "75"} in rules
    assert {"action": "RETRY", "onExitCode": "79"} in rules  # a bad host: terminated, then retried on another
    assert exit_action(rules, 79, "", "Essential container in task exited") == "RETRY"
    assert exit_action(rules, 1, "", "Essential container in task exited") == "EXIT"
    assert rules[-1] == {"action": "EXIT", "onReason": "*"}  # anything unmatched ends the job
    # the same nodes give the same name; another run, stage or share does not change it
    again = build_job_definition(_spec(itype="trn1.32xlarge", nodes=4, train={"steps": 7, "checkpoint_url": "s3://x-y/z"}),
                                 TARGET)
    assert again["jobDefinitionName"] == definition["jobDefinitionName"]
    bigger = build_job_definition(_spec(itype="trn1.32xlarge", nodes=8), TARGET)
    assert bigger["jobDefinitionName"] != definition["jobDefinitionName"]
    assert definition["jobDefinitionName"].startswith("trnflow-embed-")
    # a declared team's: `trnflow-<team>_`, its Batch log streams' start, which its spot instances' role writes alone
    search = Team(name="search", checkpoints="s3://c/search", registry="s3://c/r/search", outputs="s3://o/search",
                  cache="s3://k/search")
    named = build_job_definition(spec, dataclasses.replace(TARGET, team=search))["jobDefinitionName"]
    assert named.startswith("trnflow-search_embed-") and named.endswith(definition["jobDefinitionName"][-12:])


def test_the_batch_submission_carries_the_run_the_node_count_and_fair_share():
    spec = _spec(itype="trn1.32xlarge", nodes=4, compute={"share_identifier": "search", "scheduling_priority": 7})
    request = JobRequest(spec, "train", "r9")
    submit = build_submit_job(request, TARGET, "trnflow-embed-0123456789ab")
    assert submit["jobName"] == "embed-train-r9" and submit["jobQueue"] == "trn1-fair-share"
    assert submit["jobDefinition"] == "trnflow-embed-0123456789ab"
    assert submit["shareIdentifier"] == "search" and submit["schedulingPriorityOverride"] == 7
    overrides = submit["nodeOverrides"]
    assert overrides["numNodes"] == 4
    env = {e["name"]: e["value"] for e in overrides["nodePropertyOverrides"][0]["containerOverrides"]["environment"]}
    assert env["TRNFLOW_PHASE"] == "train" and env["TRNFLOW_NPROC_PER_NODE"] == "32"
    assert env["TRNFLOW_CHECKPOINT_S3_URI"] == "s3://acme-ckpt/embed/r9"  # every attempt resumes from here
    assert submit["retryStrategy"]["evaluateOnExit"][-1] == {"action": "EXIT", "onReason": "*"}
    plain = build_submit_job(JobRequest(_spec(itype="trn1.32xlarge", nodes=2), "train", "r9"), TARGET, "d")
    assert "shareIdentifier" not in plain and "schedulingPriorityOverride" not in plain


def test_a_batch_spot_job_is_a_single_node_job_on_the_spot_queue_that_reads_ec2s_notice():
    """Batch runs no multi-node job on spot compute environments: a one-node spot spec gets a
    single-node definition (no EFA, which the spot environment's instances do not attach) and goes to
    the spot queue; the container is told to watch for the reclaim notice. Both requests are valid
    for the service."""
    spec = _spec(itype="trn1.32xlarge", nodes=1, cores=2, compute={"backend": "batch", "spot": True})
    target = dataclasses.replace(TARGET, spot_job_queue="trn1-spot")
    definition = build_job_definition(spec, target)
    assert definition["type"] == "container" and "nodeProperties" not in definition
    container = definition["containerProperties"]
    assert [d["hostPath"] for d in container["linuxParameters"]["devices"]] == [f"/dev/neuron{i}" for i in range(16)]
    assert container["environment"] == [] and "instanceType" not in container  # Batch ignores it on one node
    # all but the host's share of the vCPUs: no smaller instance can take it, and no other job can share its one
    assert {"type": "VCPU", "value": "96"} in container["resourceRequirements"]
    assert {"action": "RETRY", "onExitCode": "75"} in definition["retryStrategy"]["evaluateOnExit"]
    submit = build_submit_job(JobRequest(spec, "train", "r5"), target, definition["jobDefinitionName"])
    assert submit["jobQueue"] == "trn1-spot" and "nodeOverrides" not in submit
    env = {e["name"]: e["value"] for e in submit["containerOverrides"]["environment"]}
    assert env["TRNFLOW_SPOT"] == "1" and env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "100"
    assert not {k for k in env if k.startswith(("FI_", "RDMAV_"))}  # the spot environment attaches no EFA
    assert submit["tags"]["trnflow:spot"] == "true"
    _valid_for_the_service("batch", "RegisterJobDefinition", definition)
    _valid_for_the_service("batch", "SubmitJob", submit)
    with pytest.raises(FatalError, match="has no EFA"):  # on demand, the same type cannot be a multi-node job
        build_job_definition(_spec(itype="trn1.2xlarge", nodes=1, cores=2, compute={"backend": "batch"}), target)
    assert queue_problems(spec, "", None) == [
        "compute.spot: a spot job goes to the deployment's spot queue, and TRNFLOW_BATCH_SPOT_JOB_QUEUE is not set; "
        "set it to the BatchSpotJobQueue output of the CloudFormation stack in infra/"]


def test_a_job_for_the_preflight_then_training_runs_as_trainings_role_with_the_wait_in_its_time_limit():
    roles = {kind: f"arn:aws:iam::123456789012:role/trnflow-job-{kind}" for kind in ("preflight", "train")}
    target = CloudTarget(image=TARGET.image, staging_url=TARGET.staging_url, role_arn=TARGET.role_arn,
                         job_queue=TARGET.job_queue, roles=roles)
    spec = _spec(itype="trn1.32xlarge", compute={"max_pending_minutes": 40, "hang_timeout_minutes": 20})
    chained = JobRequest(spec, "sanity+train", "r3")
    assert chained.phases == ("sanity", "train") and chained.last_phase == "train"
    wait = (40 + 20) * 60
    body = build_training_job_request(chained, target)
    assert body["RoleArn"] == roles["train"] and body["HyperParameters"]["phase"] == "sanity+train"
    assert body["TrainingJobName"].startswith("embed-sanity-train-r3")
    assert [c["ChannelName"] for c in body["InputDataConfig"]] == ["spec", "train", "holdout"]
    assert body["StoppingCondition"]["MaxRuntimeInSeconds"] == 6 * 3600 + wait
    assert body["Environment"]["TRNFLOW_PROCEED_TIMEOUT_SECONDS"] == str(wait)
    _valid_for_the_service("sagemaker", "CreateTrainingJob", body)
    alone = build_training_job_request(JobRequest(spec, "sanity", "r3"), target)
    assert alone["RoleArn"] == roles["preflight"] and "TRNFLOW_PROCEED_TIMEOUT_SECONDS" not in alone["Environment"]
    assert alone["StoppingCondition"]["MaxRuntimeInSeconds"] == 6 * 3600

    submit = build_submit_job(chained, target, "trnflow-embed-0123456789ab")
    assert submit["jobName"] == "embed-sanity-train-r3"
    assert submit["timeout"]["attemptDurationSeconds"] == 6 * 3600 + wait
    _valid_for_the_service("batch", "SubmitJob", submit)
    definition = build_job_definition(spec, target, chained.last_phase)
    assert definition["nodeProperties"]["nodeRangeProperties"][0]["container"]["jobRoleArn"] == roles["train"]


def _container(spec):
    return build_job_definition(spec, TARGET)["nodeProperties"]["nodeRangeProperties"][0]["container"]


def test_batch_container_memory_is_the_spec_s_or_what_the_instance_can_give():
    memory = {r["type"]: r["value"] for r in _container(_spec(itype="trn1.32xlarge", nodes=2))["resourceRequirements"]}
    assert memory["MEMORY"] == str((512 - 12) * 1024)  # trn1.32xlarge has 512 GiB; 12 GiB stay with the host
    asked = _spec(itype="trn1.32xlarge", nodes=2, compute={"memory_gib": 256})
    assert {"type": "MEMORY", "value": str(256 * 1024)} in _container(asked)["resourceRequirements"]
    assert validate_spec(quickstart_data(compute={"instance_type": "trn2.48xlarge", "cores_per_node": 2,
                                                  "memory_gib": 2036})).compute.container_memory_gib == 2036


@pytest.mark.parametrize(("itype", "asked", "has", "limit", "bigger"), [
    ("trn1.32xlarge", 600, 512, 500, "trn2.48xlarge (2048 GiB)"),
    ("trn1.2xlarge", 32, 32, 20, "trn1.32xlarge (512 GiB)"),
    ("trn2.48xlarge", 4096, 2048, 2036, None)])
def test_batch_memory_beyond_the_instance_is_refused_with_the_numbers(itype, asked, has, limit, bigger):
    with pytest.raises(SpecError) as caught:
        validate_spec(quickstart_data(compute={"backend": "batch", "instance_type": itype, "memory_gib": asked}))
    (problem,) = caught.value.problems
    assert problem.startswith(f"compute.memory_gib: {asked} GiB is more than a {itype} container can have: "
                              f"the instance has {has} GiB, less 12 GiB")
    assert f"leaves {limit} GiB; set compute.memory_gib <= {limit}" in problem
    assert (f"or pick {bigger}" in problem) if bigger else "or pick" not in problem


def test_the_batch_definition_never_asks_more_memory_than_the_instance_has():
    """A spec changed after validation (`model_copy` does not validate) is refused by the builder."""
    spec = _spec(itype="trn1.32xlarge", nodes=2)
    greedy = spec.model_copy(update={"compute": spec.compute.model_copy(update={"memory_gib": 512})})
    with pytest.raises(FatalError, match=r"compute\.memory_gib: 512 GiB is more than a trn1\.32xlarge container"):
        build_job_definition(greedy, TARGET)


def test_a_spec_that_declares_a_fair_share_queue_needs_a_share_identifier():
    with pytest.raises(SpecError) as caught:
        validate_spec(quickstart_data(compute={"backend": "batch", "instance_type": "trn1.32xlarge",
                                               "fair_share": True}))
    (problem,) = caught.value.problems
    assert problem.startswith("compute.share_identifier: compute.fair_share says the Batch job queue has a "
                              "fair-share scheduling policy")
    assert "shareIdentifier must be specified" in problem and "set compute.share_identifier" in problem
    with pytest.raises(SpecError, match=r"compute\.share_identifier: compute\.fair_share: false .* remove "
                                        r"compute\.share_identifier"):
        validate_spec(quickstart_data(compute={"fair_share": False, "share_identifier": "search"}))
    declared = _spec(itype="trn1.32xlarge", compute={"fair_share": True, "share_identifier": "search"})
    assert build_submit_job(JobRequest(declared, "train", "r1"), TARGET, "d")["shareIdentifier"] == "search"


FAIR_SHARE = {"jobQueueName": "trn1-fair-share", "state": "ENABLED",
              "schedulingPolicyArn": "arn:aws:batch:us-east-1:123456789012:scheduling-policy/trnflow-fair-share"}


def test_the_job_queue_s_fair_share_policy_decides_the_share_identifier():
    plain = _spec(itype="trn1.32xlarge", nodes=2)
    shared = _spec(itype="trn1.32xlarge", nodes=2, compute={"share_identifier": "search"})
    (missing,) = queue_problems(plain, "trn1-fair-share", FAIR_SHARE)
    assert missing.startswith("compute.share_identifier: the job queue trn1-fair-share has a fair-share scheduling "
                              f"policy ({FAIR_SHARE['schedulingPolicyArn']})")
    assert "shareIdentifier must be specified" in missing and "set compute.share_identifier" in missing
    assert queue_problems(shared, "trn1-fair-share", FAIR_SHARE) == []
    fifo = {"jobQueueName": "fifo", "state": "ENABLED"}
    assert queue_problems(plain, "fifo", fifo) == []
    (stray,) = queue_problems(shared, "fifo", fifo)
    assert stray.startswith("compute.share_identifier: the job queue fifo has no fair-share scheduling policy")
    (unknown,) = queue_problems(plain, "nosuch", None)
    assert unknown.startswith("TRNFLOW_BATCH_JOB_QUEUE: AWS Batch has no job queue 'nosuch'")


def test_batch_refuses_an_instance_without_efa():
    with pytest.raises(FatalError, match="has no EFA"):
        build_job_definition(_spec(itype="trn1.2xlarge", nodes=1, cores=2), TARGET)


ENV = {"TRNFLOW_NPROC_PER_NODE": "32", "TRNFLOW_PHASE": "train", "TRNFLOW_RUN_ID": "r9"}


def test_batch_nodes_rendezvous_at_the_main_node():
    main = batch_rendezvous({"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "0",
                             "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}, own_address="10.0.0.5")
    child = batch_rendezvous({"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "2",
                              "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0",
                              "AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS": "10.0.0.5"})
    assert (main.master_addr, main.node_rank, main.nnodes) == ("10.0.0.5", 0, 4)
    assert (child.master_addr, child.node_rank, child.master_port) == ("10.0.0.5", 2, 41000)
    argv = torchrun_argv(child, ENV, Path("/tmp/spec.json"))
    # trnflow's launcher (torchrun, ranks forked, their output in the container's log stream)
    assert argv[1:5] == ["-m", "trnflow.backends.launcher", "--console", "/tmp/trnflow-ranks"]
    assert argv[argv.index("--nnodes") + 1] == "4" and argv[argv.index("--node-rank") + 1] == "2"
    assert argv[argv.index("--nproc-per-node") + 1] == "32" and argv[argv.index("--master-addr") + 1] == "10.0.0.5"
    assert argv[argv.index("-m", argv.index("--master-port")) + 1:][:2] == ["trnflow.workload", "train"]
    with pytest.raises(FatalError, match="no AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"):
        batch_rendezvous({"AWS_BATCH_JOB_NUM_NODES": "4", "AWS_BATCH_JOB_NODE_INDEX": "3"})


def test_sagemaker_hosts_rendezvous_at_algo_1():
    env = {"SM_HOSTS": json.dumps(["algo-2", "algo-1"]), "SM_CURRENT_HOST": "algo-2", "SM_MASTER_ADDR": "algo-1",
           "SM_MASTER_PORT": "7777", "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data"}
    r = sagemaker_rendezvous(env)
    assert (r.nnodes, r.node_rank, r.master_addr, r.master_port) == (2, 1, "algo-1", 7777)
    argv = torchrun_argv(r, {**ENV, "TRNFLOW_CHECKPOINT": "s3://c/r/step-000010"}, Path("/opt/ml/input/spec.json"))
    assert argv[-2:] == ["--checkpoint", "s3://c/r/step-000010"]
    assert argv[argv.index("--output") + 1] == "/opt/ml/output/data"


def test_the_cloud_target_comes_from_settings_and_names_what_is_missing(in_process_aws, monkeypatch):
    from trnflow.backends.cloud import cloud_target
    from trnflow.settings import TrnflowSettings

    monkeypatch.setenv("TRNFLOW_IMAGE", TARGET.image)
    monkeypatch.setenv("TRNFLOW_STAGING_URL", TARGET.staging_url)
    monkeypatch.setenv("TRNFLOW_BATCH_JOB_QUEUE", TARGET.job_queue)
    monkeypatch.delenv("TRNFLOW_SAGEMAKER_ROLE_ARN", raising=False)
    for service in ("batch", "sagemaker"):  # each job runs as a role: made from the stack's policies, or a fixed one
        with pytest.raises(FatalError, match=r"needs TRNFLOW_JOB_POLICIES \(or TRNFLOW_SAGEMAKER_ROLE_ARN\); set "
                                             "them from the outputs"):
            cloud_target(TrnflowSettings(), service)
    monkeypatch.setenv("TRNFLOW_JOB_POLICIES", "arn:aws:iam::123456789012:policy/trnflow/")
    target = cloud_target(TrnflowSettings(), "batch")
    assert target.job_queue == "trn1-fair-share" and target.job_policies.endswith(":policy/trnflow/")


def test_the_published_cache_key_is_read_even_when_the_environment_names_everything_else(in_process_aws,
                                                                                         monkeypatch):
    """Every other setting is in the environment; the stack published the cache's public key in SSM
    alone. The target has it, and the jobs check entries with it."""
    import boto3

    from trnflow.backends.cloud import cloud_target
    from trnflow.settings import TrnflowSettings

    for name, value in {"TRNFLOW_IMAGE": TARGET.image, "TRNFLOW_STAGING_URL": TARGET.staging_url,
                        "TRNFLOW_BATCH_JOB_QUEUE": TARGET.job_queue,
                        "TRNFLOW_JOB_POLICIES": "arn:aws:iam::123456789012:policy/trnflow/"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRNFLOW_CACHE_PUBLIC_KEY", raising=False)
    key = "ed25519:" + "B" * 43 + "="
    boto3.client("ssm").put_parameter(Name="/trnflow/cache-public-key", Value=key, Type="String")
    target = cloud_target(TrnflowSettings(), "batch")
    assert target.cache_public_key == key
    assert container_environment(JobRequest(_spec(), "train", "r1"), target)[
        "TRNFLOW_CACHE_PUBLIC_KEY"] == key


def test_settings_that_cannot_be_read_stop_a_cloud_run(monkeypatch, tmp_path):
    """SSM cannot be read (here: no credentials at all): the run stops, naming the path, instead of
    going on without a key."""
    from trnflow.backends.cloud import cloud_target
    from trnflow.settings import TrnflowSettings

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"TRNFLOW_IMAGE": TARGET.image, "TRNFLOW_STAGING_URL": TARGET.staging_url,
                        "TRNFLOW_BATCH_JOB_QUEUE": TARGET.job_queue, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"),
                        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_EC2_METADATA_DISABLED": "true"
                        }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(FatalError, match="the settings published under /trnflow/ in SSM cannot be read"):
        cloud_target(TrnflowSettings(), "batch")


REPOSITORY = "123456789012.dkr.ecr.us-east-1.amazonaws.com/trnflow-train"
BY_DEVICE = CloudTarget(staging_url=TARGET.staging_url, role_arn=TARGET.role_arn, job_queue=TARGET.job_queue,
                        images={"neuron": f"{REPOSITORY}:neuron", "xla": f"{REPOSITORY}:xla"})


@pytest.mark.parametrize(("itype", "device", "image"), [
    ("trn1n.32xlarge", "auto", "xla"), ("trn1.32xlarge", "emulator", "xla"), ("trn2.48xlarge", "auto", "neuron"),
    ("trn2.48xlarge", "emulator", "neuron"), ("trn2.48xlarge", "xla", "xla")])
def test_both_services_run_the_image_of_the_jobs_device(itype, device, image):
    """trn1 runs torch-xla's image, trn2 TorchNeuron's; a spec that names a device gets that device's."""
    spec = _spec(itype, compute={"device": device})
    request = JobRequest(spec, "train", "20261123-run")
    assert build_training_job_request(request, BY_DEVICE)["AlgorithmSpecification"]["TrainingImage"] == \
        f"{REPOSITORY}:{image}"
    definition = build_job_definition(spec, BY_DEVICE)
    assert definition["nodeProperties"]["nodeRangeProperties"][0]["container"]["image"] == f"{REPOSITORY}:{image}"


def test_a_job_whose_image_is_not_set_says_which_setting_to_set():
    only_xla = CloudTarget(staging_url=TARGET.staging_url, role_arn=TARGET.role_arn, images={"xla": "r:xla"})
    with pytest.raises(FatalError, match="runs the neuron training image, and none is set: set TRNFLOW_IMAGE_NEURON"):
        build_training_job_request(JobRequest(_spec("trn2.48xlarge"), "train", "r1"), only_xla)


def test_the_images_come_from_settings_one_per_device_or_one_for_all(in_process_aws, monkeypatch):
    from trnflow.backends.cloud import cloud_target
    from trnflow.settings import TrnflowSettings

    for name, value in {"TRNFLOW_IMAGE_NEURON": f"{REPOSITORY}:neuron", "TRNFLOW_IMAGE_XLA": f"{REPOSITORY}:xla",
                        "TRNFLOW_STAGING_URL": TARGET.staging_url, "TRNFLOW_BATCH_JOB_QUEUE": "q",
                        "TRNFLOW_SAGEMAKER_ROLE_ARN": TARGET.role_arn}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TRNFLOW_IMAGE", raising=False)
    assert cloud_target(TrnflowSettings(), "batch").images == BY_DEVICE.images
    monkeypatch.delenv("TRNFLOW_IMAGE_NEURON")
    monkeypatch.delenv("TRNFLOW_IMAGE_XLA")
    monkeypatch.setenv("TRNFLOW_PARAMETERS_PATH", "/nowhere")  # nothing published there
    with pytest.raises(FatalError, match="needs TRNFLOW_IMAGE or TRNFLOW_IMAGE_NEURON or TRNFLOW_IMAGE_XLA"):
        cloud_target(TrnflowSettings(), "batch")


@pytest.mark.slow  # imports the SageMaker SDK (about 3 s): with the integration tests
def test_the_sdk_checks_trnflows_config_once_per_submission_and_any_other_config_every_time(
        in_process_aws, monkeypatch):
    """The SDK checks a session's config against its schema at every value it reads, a dozen times
    per submission at 0.45 CPU-s each; trnflow's constant config is checked when its session is made."""
    import boto3
    import jsonschema
    from sagemaker.core.config.config_manager import SageMakerConfig

    from trnflow.backends import sagemaker_trainer

    real, checked = jsonschema.validate, []
    monkeypatch.setattr(jsonschema, "validate", lambda instance, schema, *a, **k: (
        checked.append(instance), real(instance, schema, *a, **k))[1])
    monkeypatch.setenv("SAGEMAKER_VALIDATE_ROLE", "false")  # the SDK's role check needs IAM's simulator
    boto3.client("s3").create_bucket(Bucket="acme-staging")
    body = build_training_job_request(JobRequest(_spec(nodes=1), "train", "r1"), TARGET)
    names = [sagemaker_trainer.submit(body, boto3.Session(), "acme-staging") for _ in range(2)]

    sent = boto3.client("sagemaker").describe_training_job(TrainingJobName=names[-1])
    assert sent["ResourceConfig"]["InstanceType"] == "ml.trn1n.32xlarge"
    assert sent["HyperParameters"] == body["HyperParameters"] and sent["RoleArn"] == TARGET.role_arn
    ours = sum(config is sagemaker_trainer.TELEMETRY_OFF for config in checked)
    assert 2 <= ours <= 3  # each session's check, and the first submission's once per process
    with pytest.raises(jsonschema.ValidationError):  # any other config is still checked, every time
        SageMakerConfig.validate_sagemaker_config({"SchemaVersion": "1.0", "SageMaker": {"NoSuchKey": 1}})


@pytest.mark.parametrize("backend", ["sagemaker", "batch"])
def test_every_location_a_cloud_job_uses_must_be_on_s3_and_each_bad_one_is_named(backend):
    """A cloud job's hosts never see this machine's folders: the data, checkpoints, compile cache,
    outputs and starting model each must be on S3, and each one that is not is listed. The gate's
    reference and the registry are read by the flow's own process, so they may be local."""
    cloud = {"backend": backend, "instance_type": "trn1.32xlarge", "nodes": 2, "cores_per_node": 1}
    with pytest.raises(SpecError) as caught:
        validate_spec(quickstart_data(compute=cloud, train={"init_from": "/models/base.pt"},
                                      gate={"reference": "/refs/metrics.json"}), "s.yaml")
    named = [p.split(":")[0] for p in caught.value.problems]
    assert named == ["data.train", "data.holdout", "data.inference", "train.checkpoint_url", "train.init_from",
                     "compile.cache_url", "inference.output_url"]
    assert all("is not on S3" in p for p in caught.value.problems)
    s3 = {"train": "s3://acme-data/train", "holdout": "s3://acme-data/holdout", "inference": "s3://acme-data/inference"}
    spec = validate_spec(quickstart_data(
        compute=cloud, data=s3, compile={"cache_url": "s3://acme-data/cache"}, inference={"output_url": "s3://acme-data/out"},
        train={"checkpoint_url": "s3://acme-data/ckpt"}, gate={"reference": "/refs/metrics.json"},
        registry_url="/registry"))
    assert spec.gate.reference == "file:///refs/metrics.json"
    with pytest.raises(SpecError, match=r"registry_url: file:///registry is not on S3"):
        validate_spec(quickstart_data(compute=cloud, data=s3, compile={"cache_url": "s3://acme-data/cache"},
                                      inference={"output_url": "s3://acme-data/out"},
                                      train={"checkpoint_url": "s3://acme-data/ckpt", "init_from": "champion"},
                                      registry_url="/registry"))


def test_module_recipes_reach_cloud_jobs_only_where_the_submitter_allows_them(monkeypatch):
    """A spec naming its recipe by module is carried out by jobs that may import it only when
    TRNFLOW_RECIPE_MODULES is set where they are submitted; an installed recipe needs nothing."""
    import dataclasses

    from trnflow.backends.cloud import container_environment

    monkeypatch.setenv("TRNFLOW_RECIPE_MODULES", "1")  # so the spec validates here
    by_module = _spec(model={"recipe": "trnflow.workload.recipes.hf_encoder:HfEncoder"})
    allowed = dataclasses.replace(TARGET, recipe_modules=True)
    assert container_environment(JobRequest(by_module, "train", "r"), allowed)["TRNFLOW_RECIPE_MODULES"] == "1"
    assert "TRNFLOW_RECIPE_MODULES" not in container_environment(JobRequest(by_module, "train", "r"), TARGET)
    assert "TRNFLOW_RECIPE_MODULES" not in container_environment(JobRequest(_spec(), "train", "r"), allowed)


def test_every_cloud_job_checks_cache_entries_and_only_compile_jobs_are_told_where_the_signing_key_is():
    import dataclasses

    from trnflow.backends.cloud import container_environment

    arn = "arn:aws:secretsmanager:us-east-1:123456789012:secret:trnflow-cache-signing-AbCdEf"
    signed = dataclasses.replace(TARGET, cache_public_key="ed25519:" + "A" * 43 + "=", cache_signing_key=arn)
    for phase in ("sanity", "compile", "train", "evaluate", "infer"):
        env = container_environment(JobRequest(_spec(), phase, "r"), signed)
        assert env["TRNFLOW_CACHE_PUBLIC_KEY"] == signed.cache_public_key
        assert env.get("TRNFLOW_CACHE_SIGNING_KEY") == (arn if phase == "compile" else None)
    a_file = dataclasses.replace(signed, cache_signing_key="/home/me/cache.pem")  # a path: never sent anywhere
    assert "TRNFLOW_CACHE_SIGNING_KEY" not in container_environment(JobRequest(_spec(), "compile", "r"), a_file)
    assert not {"TRNFLOW_CACHE_PUBLIC_KEY", "TRNFLOW_CACHE_SIGNING_KEY"} & set(
        container_environment(JobRequest(_spec(), "compile", "r"), TARGET))


def test_each_stage_kind_runs_as_its_own_role_on_either_service():
    """sanity and collectives as the preflight role, compile as the compile role (the only one that
    writes the cache), train and evaluate as the training role, infer as the inference role; on
    SageMaker a kind without a role of its own falls back to the execution role, on Batch to none
    (never the instance's)."""
    import dataclasses

    roles = {kind: f"arn:aws:iam::123456789012:role/trnflow-job-{kind}" for kind in JOB_KINDS}
    # every kind has its role setting, and the settings name no other kind
    assert {name for name in TrnflowSettings.model_fields if name.startswith("role_") and name != "role_settle_seconds"
            } == {f"role_{kind}" for kind in JOB_KINDS} and set(STAGE_KINDS.values()) == set(JOB_KINDS)
    split = dataclasses.replace(TARGET, roles=roles)
    want = {"sanity": "preflight", "collectives": "preflight", "compile": "compile", "train": "train",
            "evaluate": "train", "infer": "infer"}
    spec = _spec(itype="trn1.32xlarge")
    for phase, kind in want.items():
        assert build_training_job_request(JobRequest(spec, phase, "r"), split)["RoleArn"] == roles[kind]
        container = build_job_definition(spec, split, phase)["nodeProperties"]["nodeRangeProperties"][0]["container"]
        assert container["jobRoleArn"] == roles[kind]
    names = {build_job_definition(spec, split, phase)["jobDefinitionName"] for phase in want}
    assert len(names) == 4  # a definition per role
    only_train = dataclasses.replace(TARGET, roles={"train": roles["train"]})
    assert build_training_job_request(JobRequest(spec, "compile", "r"), only_train)["RoleArn"] == TARGET.role_arn
    container = build_job_definition(spec, only_train, "compile")["nodeProperties"]["nodeRangeProperties"][0]
    assert container["container"]["jobRoleArn"] == TARGET.role_arn  # never none: never the instance's role
    no_role = dataclasses.replace(TARGET, role_arn="", roles={"train": roles["train"]})
    with pytest.raises(FatalError, match=r"the compile phase has no role to run as: set TRNFLOW_JOB_POLICIES .*"
                                         r"or TRNFLOW_ROLE_COMPILE or TRNFLOW_SAGEMAKER_ROLE_ARN"):
        build_job_definition(spec, no_role, "compile")
    made = "arn:aws:iam::123456789012:role/trnflow/trnflow-run-compile-0123456789abcdef"  # a job's own role
    assert build_training_job_request(JobRequest(spec, "compile", "r"), no_role, made)["RoleArn"] == made
    assert build_job_definition(spec, no_role, "compile", made)["nodeProperties"]["nodeRangeProperties"][0][
        "container"]["jobRoleArn"] == made


def test_every_backend_declares_what_its_callers_use_of_it(tmp_path, in_process_aws):
    """The stage tasks use only what the Backend protocol declares: whether a job's phases share
    one allocation, who picks the instance type, where a job's nodes report, how to stop it by hand."""
    from trnflow.backends.base import Backend
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.local import LocalBackend
    from trnflow.backends.sagemaker import SageMakerBackend

    local = LocalBackend(tmp_path / "jobs")
    clouds = [SageMakerBackend(TARGET), BatchBackend(TARGET)]
    assert all(isinstance(b, Backend) for b in (local, *clouds))
    ways = {b.name: (b.shares_allocation, b.picks_instance_type) for b in (local, *clouds)}
    assert ways == {"local": (False, True), "sagemaker": (True, True), "batch": (True, False)}
    assert local.outputs("any") is None
    assert "aws sagemaker stop-training-job" in clouds[0].stop_command("job-1")
    assert "aws batch terminate-job" in clouds[1].stop_command("job-1")
    assert "job-1" in local.stop_command("job-1")


def test_the_jobs_contract_is_written_and_read_back_by_one_model(in_process_aws):
    """The orchestrator writes a job's TRNFLOW_* variables from JobEnv and the container reads them
    back with it: the same values, and a malformed one fails naming its variable's field."""
    from pydantic import ValidationError

    from trnflow.backends.cloud import container_environment
    from trnflow.backends.contract import JobEnv, JobOutputs

    spec = validate_spec(quickstart_data(compute={"backend": "sagemaker", "spot": True}, **ON_S3,
                                         train={"checkpoint_url": "s3://acme-data/checkpoints"}))
    env = container_environment(JobRequest(spec, "sanity+train", "run-7", checkpoint="s3://c/step-1"), TARGET)
    job = JobEnv.from_env(env)
    assert (job.phase, job.run_id, job.checkpoint, job.spot, job.nproc_per_node) == ("sanity+train", "run-7",
                                                                                      "s3://c/step-1", True, 2)
    assert job.proceed_timeout_seconds > 0 and job.result_url.endswith("/output")
    assert JobEnv.from_env(job.to_env()) == job and {k: env[k] for k in job.to_env()} == job.to_env()
    with pytest.raises(ValidationError, match="nproc_per_node"):
        JobEnv.from_env({**env, JobEnv.var("nproc_per_node"): "two"})
    assert JobOutputs.NODE_FAILURE.fullmatch(JobOutputs.node_failure(3)).group(1) == "3"
    assert JobOutputs.host(2, 1) == "hosts/attempt2/node1.json" and JobOutputs.proceed("train") == "proceed-train.json"


def test_trainings_budget_travels_in_the_request_never_in_the_spec(tmp_path):
    from trnflow.backends.container import _budget
    from trnflow.neuron.launch import launch_command
    from trnflow.workload.__main__ import _parse

    spec = _spec(itype="trn1.32xlarge")
    body = build_training_job_request(JobRequest(spec, "train", "r4", budget_usd=1.2345), TARGET)
    assert body["Environment"]["TRNFLOW_BUDGET_USD"] == "1.2345" and spec.train.max_cost_usd is None
    unlimited = build_training_job_request(JobRequest(spec, "train", "r4"), TARGET)
    assert "TRNFLOW_BUDGET_USD" not in unlimited["Environment"]
    r = sagemaker_rendezvous({"SM_HOSTS": json.dumps(["algo-1"]), "SM_CURRENT_HOST": "algo-1",
                              "SM_OUTPUT_DATA_DIR": "/opt/ml/output/data"})
    argv = torchrun_argv(r, {**ENV, "TRNFLOW_BUDGET_USD": "1.2345"}, Path("/opt/ml/input/spec.json"))
    assert argv[-2:] == ["--budget-usd", "1.2345"]
    later = _budget({**ENV, "TRNFLOW_BUDGET_USD": "1.2345"}, 0.5)  # a kept job's train phase: its word's budget
    assert torchrun_argv(r, later, Path("/opt/ml/input/spec.json"))[-2:] == ["--budget-usd", "0.5"]
    local = launch_command("train", 2, tmp_path, "r4", budget_usd=0.25)
    assert local[-2:] == ["--budget-usd", "0.25"] and "--budget-usd" not in launch_command("train", 2, tmp_path, "r4")
    parsed = _parse(["train", "--budget-usd", "0.25", "--run-id", "r4"])
    assert parsed.budget_usd == 0.25
    with pytest.raises(SystemExit):
        _parse(["train", "--budget-usd", "-1"])
