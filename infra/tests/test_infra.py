"""The infrastructure as code: the CloudFormation template lints clean, deploys into moto (with
the one change moto needs, below), and its resources are then found through the service APIs;
no IAM statement allows `*` on `*`; every bucket is encrypted and private; the training image's
entrypoint is the container contract."""

import base64
import json
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from cfnlint.decode import decode_str

from tests.conftest import ON_S3, in_process_aws, quickstart_data  # noqa: F401 (a fixture)
from trnflow.backends import JobRequest
from trnflow.backends.cloud import published_settings
from trnflow.settings import JOB_KINDS
from trnflow.specs import validate_spec
from trnflow.specs.spec import BATCH_SPOT_TYPES

INFRA = Path(__file__).resolve().parents[1]
TEMPLATE = INFRA / "cloudformation" / "trnflow.yaml"
TEAM_TEMPLATE = INFRA / "cloudformation" / "team.yaml"


def _template(path: Path = TEMPLATE) -> dict:
    template, errors = decode_str(path.read_text())
    assert not errors, errors
    return json.loads(json.dumps(template))


def _of_type(template: dict, kind: str) -> dict:
    return {name: r["Properties"] for name, r in template["Resources"].items() if r["Type"] == kind}


def test_the_templates_lint_clean():
    lint = Path(sys.executable).with_name("cfn-lint")
    result = subprocess.run([str(lint), str(TEMPLATE), str(TEAM_TEMPLATE)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _statements(template: dict):
    for name, props in template["Resources"].items():
        documents = [props["Properties"].get("PolicyDocument")] + [
            p["PolicyDocument"] for p in props["Properties"].get("Policies", [])]
        for document in filter(None, documents):
            for statement in document["Statement"]:
                yield name, statement


@pytest.mark.parametrize("path", [TEMPLATE, TEAM_TEMPLATE], ids=lambda p: p.name)
def test_no_statement_allows_every_action_or_a_wildcard_action_on_every_resource(path):
    statements = [(n, s) for n, s in _statements(_template(path)) if s["Effect"] == "Allow"]
    assert len(statements) >= 6
    for name, statement in statements:
        actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
        resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        assert "*" not in actions and not any(a.endswith(":*") for a in actions), (name, statement)
        if "*" in resources:  # only actions that AWS defines on no resource (each named), none of them a write
            assert set(actions) <= {"ecr:GetAuthorizationToken", "cloudwatch:PutMetricData", "batch:DescribeJobs",
                                    "batch:DescribeJobQueues", "batch:DescribeJobDefinitions", "batch:ListJobs",
                                    "batch:DescribeComputeEnvironments", "ec2:DescribeInstances",
                                    "ec2:DescribeSpotPriceHistory", "iam:ListRoles",
                                    "ecs:DiscoverPollEndpoint", "ec2:DescribeTags"}, (
                name, statement)


def test_every_bucket_is_encrypted_private_and_versioned_where_loss_matters():
    buckets = _of_type(_template(), "AWS::S3::Bucket")
    assert len(buckets) == 6  # data, checkpoints, compile cache, outputs, staging, and their access logs
    for name, props in buckets.items():
        block = props["PublicAccessBlockConfiguration"]
        assert all(block[k] for k in ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls",
                                      "RestrictPublicBuckets")), name
        assert props["BucketEncryption"]["ServerSideEncryptionConfiguration"], name
    for name, props in buckets.items():  # what was there before any write can be found again
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}, name
        assert name == "AccessLogBucket" or props["LoggingConfiguration"]["DestinationBucketName"] == {
            "Ref": "AccessLogBucket"}, name


@pytest.mark.usefixtures("in_process_aws")
def test_the_stack_deploys_into_moto_and_its_resources_answer_through_the_apis():
    ec2 = boto3.client("ec2")
    vpc = ec2.create_vpc(CidrBlock="10.1.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.1.0.0/20")["Subnet"]["SubnetId"]
    template = _template()
    # moto's compute environment requires securityGroupIds; on AWS the launch template's EFA
    # interfaces carry the security group instead
    template["Resources"]["ComputeEnvironment"]["Properties"]["ComputeResources"]["SecurityGroupIds"] = [
        {"Ref": "NodeSecurityGroup"}]
    cloudformation = boto3.client("cloudformation")
    cloudformation.create_stack(StackName="trnflow", TemplateBody=json.dumps(template), Capabilities=[
        "CAPABILITY_NAMED_IAM"], Parameters=[{"ParameterKey": "VpcId", "ParameterValue": vpc},
                                             {"ParameterKey": "SubnetId", "ParameterValue": subnet}])
    (stack,) = cloudformation.describe_stacks(StackName="trnflow")["Stacks"]
    assert stack["StackStatus"] == "CREATE_COMPLETE"
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack["Outputs"]}
    assert outputs["StagingUrl"] == "s3://trnflow-staging-123456789012/jobs"

    s3 = boto3.client("s3")
    for key in ("DataBucket", "CheckpointBucket", "CompileCacheBucket", "OutputBucket"):
        bucket = outputs[key]  # moto's CloudFormation applies the encryption but neither the public
        rules = s3.get_bucket_encryption(Bucket=bucket)["ServerSideEncryptionConfiguration"]["Rules"]
        assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"  # access block nor
    # the versioning, which the template tests above check

    iam = boto3.client("iam")
    policies = {p["PolicyName"]: p["Arn"] for p in iam.list_policies(Scope="Local", PathPrefix="/trnflow/")["Policies"]}
    assert set(policies) == {"job-base", *(f"job-{kind}" for kind in JOB_KINDS)}
    assert all(arn.startswith(outputs["JobPolicies"]) for arn in policies.values())

    batch = boto3.client("batch")
    (queue,) = batch.describe_job_queues(jobQueues=[outputs["BatchJobQueue"]])["jobQueues"]
    assert queue["state"] == "ENABLED" and queue["status"] == "VALID"
    (environment,) = batch.describe_compute_environments(computeEnvironments=["trnflow-trn1"])[
        "computeEnvironments"]
    resources = environment["computeResources"]
    # the fallback of compute.instance_preferences needs every listed type here
    assert resources["instanceTypes"] == ["trn1.32xlarge", "trn1n.32xlarge"] and resources["minvCpus"] == 0
    # spot: single-node jobs only, on a queue and an environment of their own
    (spot_queue,) = batch.describe_job_queues(jobQueues=[outputs["BatchSpotJobQueue"]])["jobQueues"]
    (spot,) = batch.describe_compute_environments(computeEnvironments=["trnflow-trn1-spot"])["computeEnvironments"]
    assert spot_queue["computeEnvironmentOrder"][0]["computeEnvironment"] == spot["computeEnvironmentArn"]
    assert spot["computeResources"]["type"] == "SPOT"
    assert tuple(spot["computeResources"]["instanceTypes"]) == BATCH_SPOT_TYPES  # what specs are checked against
    (version,) = ec2.describe_launch_template_versions(LaunchTemplateName="trnflow-trn1-spot")["LaunchTemplateVersions"]
    user_data = base64.b64decode(version["LaunchTemplateData"]["UserData"]).decode()
    assert "ECS_ENABLE_SPOT_INSTANCE_DRAINING=true" in user_data
    (version,) = ec2.describe_launch_template_versions(LaunchTemplateName="trnflow-trn1-efa")[
        "LaunchTemplateVersions"]
    interfaces = version["LaunchTemplateData"]["NetworkInterfaces"]
    assert [i["InterfaceType"] for i in interfaces] == ["efa"] * 8
    assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(8))
    assert version["LaunchTemplateData"]["MetadataOptions"]["HttpTokens"] == "required"
    (repository,) = boto3.client("ecr").describe_repositories(repositoryNames=["trnflow-train"])["repositories"]
    assert outputs["ImageRepositoryUri"] == repository["repositoryUri"]

    # what trnflow reads from SSM when its TRNFLOW_* variables are unset: one image per device
    published = published_settings("/trnflow")
    assert published == {"image_neuron": f"{repository['repositoryUri']}:neuron",
                         "image_xla": f"{repository['repositoryUri']}:xla",
                         "staging_url": outputs["StagingUrl"], "job_policies": outputs["JobPolicies"],
                         "batch_job_queue": outputs["BatchJobQueue"],
                         "batch_spot_job_queue": outputs["BatchSpotJobQueue"]}
    # each job runs as a role made for it from the stack's policies, tagged with its run's folders
    from trnflow.backends.cloud import JobRoles, cloud_target
    from trnflow.backends.run_roles import STAGING_TAG, WRITES_TAG
    from trnflow.settings import TrnflowSettings

    target = cloud_target(TrnflowSettings(parameters_path="/trnflow", role_settle_seconds=0), "batch")
    assert target.job_policies == outputs["JobPolicies"]
    spec = validate_spec(quickstart_data(**ON_S3, compute={"backend": "batch", "instance_type": "trn1.32xlarge"},
                                         train={"checkpoint_url": f"s3://{outputs['CheckpointBucket']}/runs/m"}))
    roles = JobRoles(target)
    arn = roles.make(JobRequest(spec, "evaluate", "r7"), longest=3600)
    name = arn.rsplit("/", 1)[1]
    assert arn.startswith("arn:aws:iam::123456789012:role/trnflow/trnflow-run-train-")
    attached = {p["PolicyArn"] for p in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]}
    assert attached == {policies["job-base"], policies["job-train"]}
    tags = {t["Key"]: t["Value"] for t in iam.list_role_tags(RoleName=name)["Tags"]}
    assert tags[STAGING_TAG] == "jobs/r7" and tags[WRITES_TAG] == "runs/m/r7"
    roles.submitted("job-1", arn)
    assert roles.ended("job-1") and not roles.ended("job-1")
    assert not iam.list_roles(PathPrefix="/trnflow/")["Roles"]  # gone with its job
    # moto's CloudFormation has no AWS::Batch::SchedulingPolicy: the queue's fair share is checked
    # on the template instead
    (policy,) = _of_type(template, "AWS::Batch::SchedulingPolicy").values()
    assert policy["FairsharePolicy"]["ShareDistribution"]
    assert template["Resources"]["JobQueue"]["Properties"]["SchedulingPolicyArn"] == {"Ref": "FairShare"}

    # a team's own stack beside it: its orchestrator's role, tagged with the team, and spot capacity of its own
    cloudformation.create_stack(StackName="trnflow-search", TemplateBody=TEAM_TEMPLATE.read_text(), Capabilities=[
        "CAPABILITY_NAMED_IAM"], Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in {
            "Team": "search", "TeamsFile": "s3://trnflow-ops-123456789012/teams.yaml", "SubnetId": subnet,
            "NodeSecurityGroupId": outputs["NodeSecurityGroup"]}.items()])
    (team,) = cloudformation.describe_stacks(StackName="trnflow-search")["Stacks"]
    assert team["StackStatus"] == "CREATE_COMPLETE"
    mine = {o["OutputKey"]: o["OutputValue"] for o in team["Outputs"]}
    role = mine["OrchestratorRoleArn"].rsplit("/", 1)[1]
    assert role == "trnflow-search-orchestrator"
    assert iam.list_role_tags(RoleName=role)["Tags"] == [{"Key": "trnflow-team", "Value": "search"}]
    (own,) = batch.describe_job_queues(jobQueues=[mine["BatchSpotJobQueue"]])["jobQueues"]
    (environment,) = batch.describe_compute_environments(computeEnvironments=["trnflow-search-trn1-spot"])[
        "computeEnvironments"]
    assert own["computeEnvironmentOrder"][0]["computeEnvironment"] == environment["computeEnvironmentArn"]
    assert environment["computeResources"]["type"] == "SPOT"
    profile = environment["computeResources"]["instanceRole"]
    assert profile.endswith("instance-profile/trnflow-search-batch-spot-instance")


def test_the_training_image_runs_the_container_contract():
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m", "trnflow.backends.container"]' in dockerfile
    assert "FROM ${NEURON_DLC}" in dockerfile and "pytorch-training-neuronx" in dockerfile
