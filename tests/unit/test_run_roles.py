"""Issue 54: each cloud job's own role, made in (moto's) IAM from the stack's job policies, tagged
with the folders its run may write, and deleted when it ends or, left behind, once its time is over.
What those tags let a job write is evaluated against the stack's policies in infra/tests/test_roles.py."""

import dataclasses
import json
import time

import boto3
import pytest

from trnflow.backends.run_roles import EXPIRES_TAG, RUN_TAG, STAGING_TAG, WRITES_TAG, JobScope, PolicyPath, RunRoles
from trnflow.errors import FatalError

POLICIES = "arn:aws:iam::123456789012:policy/acme/"
SCOPE = JobScope(kind="train", run_id="20261202T101500-a1", staging="s3://acme-staging/jobs/20261202T101500-a1",
                 writes="s3://acme-checkpoints/runs/m/20261202T101500-a1")


def _policies(iam) -> None:
    for name in ("job-base", "job-preflight", "job-compile", "job-train", "job-infer"):
        iam.create_policy(PolicyName=name, Path="/acme/", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}))


def _tags(iam, name: str) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in iam.list_role_tags(RoleName=name)["Tags"]}


@pytest.mark.slow  # moto's IAM: with the integration tests
def test_a_jobs_role_is_tagged_with_its_runs_folders_gets_the_stacks_policies_and_goes(in_process_aws):
    iam = boto3.client("iam")
    _policies(iam)
    roles = RunRoles(POLICIES)
    arn = roles.make(SCOPE, "m-train-20261202T101500-a1", seconds=3600)
    name = arn.rsplit("/", 1)[1]
    assert arn.startswith("arn:aws:iam::123456789012:role/acme/acme-run-train-") and roles.where.owns(arn)
    role = iam.get_role(RoleName=name)["Role"]
    trusted = json.dumps(role["AssumeRolePolicyDocument"])
    assert "sagemaker.amazonaws.com" in trusted and "ecs-tasks.amazonaws.com" in trusted
    tags = _tags(iam, name)
    assert {k: tags[k] for k in (RUN_TAG, STAGING_TAG, WRITES_TAG)} == {
        RUN_TAG: SCOPE.run_id, STAGING_TAG: f"jobs/{SCOPE.run_id}", WRITES_TAG: f"runs/m/{SCOPE.run_id}"}
    assert time.time() + 3600 < int(tags[EXPIRES_TAG]) <= time.time() + 3600 + 2 * 86400
    attached = {p["PolicyName"] for p in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]}
    assert attached == {"job-base", "job-train"}
    # a second job of the same run and kind gets a role of its own: one's end never takes the other's
    other = roles.make(SCOPE, "m-train-20261202T101500-a1", seconds=3600)
    assert other != arn
    roles.delete(arn)
    assert [r["Arn"] for r in iam.list_roles(PathPrefix="/acme/")["Roles"]] == [other]
    roles.delete(arn)  # deleted already: nothing to do


@pytest.mark.slow  # moto's IAM: with the integration tests
def test_a_role_without_its_kinds_policy_is_not_left_behind(in_process_aws):
    iam = boto3.client("iam")
    iam.create_policy(PolicyName="job-base", Path="/acme/", PolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject", "Resource": "*"}]}))
    with pytest.raises(FatalError, match=r"cannot be given the stack's policy.*TRNFLOW_JOB_POLICIES"):
        RunRoles(POLICIES).make(SCOPE, "m-train-r", seconds=60)
    assert not iam.list_roles(PathPrefix="/acme/")["Roles"]


@pytest.mark.slow  # moto's IAM: with the integration tests
def test_a_new_role_whose_tags_iam_does_not_see_yet_is_given_its_policies_once_it_does(in_process_aws, monkeypatch):
    """The stack lets an orchestrator attach the job policies to its own team's roles alone, judged by
    the role's tags, which IAM spreads within seconds: AccessDenied for a role just made is waited out,
    a bounded number of times; any other refusal is not."""
    from botocore.exceptions import ClientError

    from trnflow.backends import run_roles

    iam = boto3.client("iam")
    _policies(iam)
    roles, waits, refusals = RunRoles(POLICIES), [], ["AccessDenied", "AccessDenied"]
    real = roles._iam.attach_role_policy

    def attach(**kwargs):
        if refusals:
            raise ClientError({"Error": {"Code": refusals.pop(0), "Message": "not authorized"}}, "AttachRolePolicy")
        return real(**kwargs)
    monkeypatch.setattr(roles._iam, "attach_role_policy", attach)
    monkeypatch.setattr(run_roles.time, "sleep", waits.append)
    name = roles.make(SCOPE, "m-train-r", seconds=60).rsplit("/", 1)[1]
    assert {p["PolicyName"] for p in iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]} == {
        "job-base", "job-train"}
    assert waits == list(run_roles.NEW_ROLE_WAITS[:2])
    refusals.extend(["AccessDenied"] * (len(run_roles.NEW_ROLE_WAITS) + 1))  # never seen: given up, role deleted
    with pytest.raises(FatalError, match="cannot be given the stack's policy"):
        roles.make(SCOPE, "m-train-r", seconds=60)
    refusals[:] = ["NoSuchEntity"]  # any other refusal: at once
    waits.clear()
    with pytest.raises(FatalError, match="cannot be given the stack's policy"):
        roles.make(SCOPE, "m-train-r", seconds=60)
    assert waits == [] and [r["RoleName"] for r in iam.list_roles(PathPrefix="/acme/")["Roles"]] == [name]


@pytest.mark.slow  # moto's IAM: with the integration tests
def test_roles_left_behind_are_deleted_once_their_time_is_over_and_no_other_role_ever(in_process_aws, monkeypatch):
    from trnflow.backends import run_roles

    iam = boto3.client("iam")
    _policies(iam)
    live = RunRoles(POLICIES).make(SCOPE, "live", seconds=3600)
    stale = RunRoles(POLICIES).make(SCOPE, "stale", seconds=3600)
    ads = RunRoles(POLICIES).make(dataclasses.replace(SCOPE, team="ads"), "ads", seconds=3600)
    for role in (stale, ads):
        iam.tag_role(RoleName=role.rsplit("/", 1)[1], Tags=[{"Key": EXPIRES_TAG, "Value": str(int(time.time()) - 1)}])
    theirs = iam.create_role(Path="/acme/", RoleName="acme-orchestrator", AssumeRolePolicyDocument="{}",
                             Tags=[{"Key": EXPIRES_TAG, "Value": "1"}])["Role"]["Arn"]
    roles = RunRoles(POLICIES)
    assert roles.sweep(SCOPE.team) == []  # this process swept within the hour (as it made the first role)
    monkeypatch.setattr(run_roles, "_SWEPT", {})
    assert roles.sweep(SCOPE.team) == [stale]  # its own team's: team ads's are its orchestrators' to sweep
    assert RunRoles(POLICIES).sweep(SCOPE.team) == []  # once an hour a process, whatever backend asks
    left = {r["Arn"] for r in iam.list_roles(PathPrefix="/acme/")["Roles"]}
    assert left == {live, ads, theirs}
    monkeypatch.setattr(run_roles, "_SWEPT", {})
    assert RunRoles(POLICIES).sweep("ads") == [ads]
    roles.delete(theirs)  # not a job role: refused
    assert theirs in {r["Arn"] for r in iam.list_roles(PathPrefix="/acme/")["Roles"]}


def test_what_iam_cannot_hold_or_a_job_cannot_write_is_refused_naming_it():
    with pytest.raises(FatalError, match=r"train.checkpoint_url is 'file:///tmp/c': a cloud job writes only to s3"):
        JobScope("train", "r1", "s3://s/jobs/r1", "file:///tmp/c").tags(0)
    with pytest.raises(FatalError, match=r"inference.output_url is 's3://out': .* never a whole bucket"):
        JobScope("infer", "r1", "s3://s/jobs/r1", "s3://out").tags(0)
    with pytest.raises(FatalError, match=r"'runs/m\(1\)/r1' cannot be a job role's trnflow-writes tag"):
        JobScope("train", "r1", "s3://s/jobs/r1", "s3://c/runs/m(1)/r1").tags(0)
    assert WRITES_TAG not in JobScope("compile", "r1", "s3://s/jobs/r1", None).tags(0)
    with pytest.raises(FatalError, match="TRNFLOW_JOB_POLICIES is 'arn:aws:iam::123456789012:role/x', not the IAM"):
        PolicyPath("arn:aws:iam::123456789012:role/x")
    where = PolicyPath(POLICIES)
    assert not where.owns("arn:aws:iam::123456789012:role/acme/acme-orchestrator")
    assert not where.owns("arn:aws:iam::999999999999:role/acme/acme-run-train-0123456789abcdef")
    assert where.owns("arn:aws:iam::123456789012:role/acme/acme-run-train-0123456789abcdef")


@pytest.mark.slow  # reads the deployment's settings from moto's SSM: with the integration tests
def test_a_folder_a_jobs_role_cannot_name_is_refused_before_the_run_starts(in_process_aws, monkeypatch):
    from tests.conftest import ON_S3, quickstart_data
    from trnflow.cli.prelaunch import launch_problems
    from trnflow.specs import validate_spec

    for name, value in {"TRNFLOW_IMAGE": "r:1", "TRNFLOW_STAGING_URL": "s3://acme-staging/jobs",
                        "TRNFLOW_JOB_POLICIES": POLICIES, "TRNFLOW_CACHE_UNSIGNED": "1"}.items():
        monkeypatch.setenv(name, value)
    spec = validate_spec(quickstart_data(**ON_S3, compute={"backend": "sagemaker", "instance_type": "trn1.2xlarge"},
                                         train={"checkpoint_url": "s3://acme-ckpt/models(1)"}))
    problems = launch_problems(spec)
    assert any("cannot be a job role's trnflow-writes tag" in p and "models(1)" in p for p in problems), problems
    fine = spec.model_copy(update={"train": spec.train.model_copy(update={"checkpoint_url": "s3://acme-ckpt/m"})})
    assert not [p for p in launch_problems(fine) if "job role" in p]


def test_a_role_that_cannot_be_deleted_yet_leaves_the_jobs_end_standing_and_is_tried_again(monkeypatch):
    from botocore.exceptions import ClientError

    from trnflow.backends.cloud import CloudTarget, JobRoles

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    roles = JobRoles(CloudTarget(staging_url="s3://acme-staging/jobs", job_policies=POLICIES))
    role, tried = "arn:aws:iam::123456789012:role/acme/acme-run-train-0123456789abcdef", []

    def delete(arn):
        tried.append(arn)
        if len(tried) == 1:
            raise ClientError({"Error": {"Code": "DeleteConflict", "Message": "policies still attached"}}, "DeleteRole")
    monkeypatch.setattr(roles._made, "delete", delete)
    roles.submitted("job-1", role)
    assert roles.ended("job-1") is False  # logged, kept: the job's end stands
    assert roles.ended("job-1") is True and roles.ended("job-1") is False
    assert tried == [role, role]


def test_a_role_outlives_every_wait_and_attempt_its_job_is_allowed():
    """No sweep deletes the role of a job that can still run: its expiry covers each Batch attempt's
    wait and runtime, and a SageMaker spot job's whole wait for each try."""
    from tests.conftest import ON_S3, quickstart_data
    from trnflow.backends import JobRequest
    from trnflow.backends.batch_request import longest_seconds as batch_longest
    from trnflow.backends.sagemaker_request import longest_seconds as sagemaker_longest
    from trnflow.specs import validate_spec

    compute = {"instance_type": "trn1.32xlarge", "max_runtime_hours": 24, "max_pending_minutes": 30}
    batch = validate_spec(quickstart_data(**ON_S3, compute={"backend": "batch", **compute},
                                          train={"checkpoint_url": "s3://acme-ckpt/m"}, retries={"max_retries": 3}))
    assert batch_longest(JobRequest(batch, "train", "r")) >= 3 * (24 * 3600 + 30 * 60)
    spot = validate_spec(quickstart_data(**ON_S3, compute={"backend": "sagemaker", "spot": True, **compute},
                                         train={"checkpoint_url": "s3://acme-ckpt/m"}, retries={"max_retries": 2}))
    assert sagemaker_longest(JobRequest(spot, "train", "r")) >= 3 * spot.compute.wait_hours * 3600 >= 3 * 24 * 3600
