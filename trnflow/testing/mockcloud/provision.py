"""The deployment trnflow's cloud backends expect, created in the emulated AWS: buckets, the jobs'
policies (from which trnflow makes each job's role), Batch compute environments (on demand, and spot)
with their queues and fair-share policy, the compile cache's signing key (a Secrets Manager secret)
and public key, and the settings published as SSM parameters. In the real account
`infra/cloudformation/trnflow.yaml` creates them; this is the same shape, made through the APIs so it
works on any moto (which checks that a policy exists before it is attached, not what it allows: the
stack's statements are evaluated by infra/tests/test_roles.py)."""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from trnflow.device.signing import public_text
from trnflow.settings import JOB_KINDS

ACCOUNT = "123456789012"
"""moto's account."""
TRUST = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Principal": {
    "Service": ["sagemaker.amazonaws.com", "batch.amazonaws.com", "ec2.amazonaws.com"]}}]}
PUBLISHED = ("IMAGE_NEURON", "IMAGE_XLA", "STAGING_URL", "JOB_POLICIES", "BATCH_JOB_QUEUE", "BATCH_SPOT_JOB_QUEUE",
             "CACHE_PUBLIC_KEY", "CACHE_SIGNING_KEY")
"""The settings the deployment publishes (TRNFLOW_<name>, and /<prefix>/<name in kebab case> in SSM)."""
SETTINGS = (*PUBLISHED, "ROLE_SETTLE_SECONDS")
"""The settings that point trnflow at it: moto's IAM has a new role everywhere at once."""
JOB_POLICIES = ("job-base", *(f"job-{kind}" for kind in JOB_KINDS))
"""The stack's job policies (`trnflow.backends.run_roles`), under the IAM path /<prefix>/."""


def signing_key(prefix: str = "trnflow") -> Ed25519PrivateKey:
    """The compile cache's signing key of the deployment `provision` makes: the same for every
    deployment of this prefix, so that a cache signed for one (a test session's warm cache) verifies
    in the next. The operator of a real deployment makes one with `trnflow cache keygen`."""
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"trnflow mock cloud {prefix}".encode()).digest())


def signing_pem(prefix: str = "trnflow") -> str:
    """`signing_key` as the PEM text `trnflow cache keygen` writes (and the stack's secret holds)."""
    return signing_key(prefix).private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption()).decode()


def provision(client: Any, prefix: str = "trnflow") -> dict[str, str]:
    """Create the deployment with `client(service)`; returns the settings that point trnflow at it
    (the names of TRNFLOW_* variables, without the prefix)."""
    s3, iam, ec2, batch = (client(s) for s in ("s3", "iam", "ec2", "batch"))
    buckets = {kind: f"{prefix}-{kind}-{ACCOUNT}" for kind in ("data", "staging")}
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    for bucket in buckets.values():
        if bucket not in existing:
            s3.create_bucket(Bucket=bucket)
    existing = {p["PolicyName"] for p in iam.list_policies(Scope="Local", PathPrefix=f"/{prefix}/")["Policies"]}
    for name in JOB_POLICIES:
        if name not in existing:  # what each allows is the stack's (infra/); moto checks only that it exists
            iam.create_policy(PolicyName=name, Path=f"/{prefix}/", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:GetObject",
                                                        "Resource": f"arn:aws:s3:::{prefix}-*/*"}]}))
    queue = f"{prefix}-trn1"
    if not batch.describe_job_queues(jobQueues=[queue])["jobQueues"]:
        vpc = ec2.create_vpc(CidrBlock="10.42.0.0/16")["Vpc"]["VpcId"]
        subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.42.0.0/20")["Subnet"]["SubnetId"]
        group = ec2.create_security_group(GroupName=f"{prefix}-efa", Description="EFA", VpcId=vpc)["GroupId"]
        service_role = iam.create_role(RoleName=f"{prefix}-batch-service",
                                       AssumeRolePolicyDocument=json.dumps(TRUST))["Role"]["Arn"]
        iam.create_role(RoleName=f"{prefix}-batch-instance", AssumeRolePolicyDocument=json.dumps(TRUST))
        profile = iam.create_instance_profile(InstanceProfileName=f"{prefix}-batch-instance")["InstanceProfile"]
        environment = batch.create_compute_environment(
            computeEnvironmentName=f"{prefix}-trn1", type="MANAGED", state="ENABLED", serviceRole=service_role,
            computeResources={"type": "EC2", "minvCpus": 0, "maxvCpus": 2048,
                              "instanceTypes": ["trn1.32xlarge", "trn1n.32xlarge"], "subnets": [subnet],
                              "securityGroupIds": [group], "instanceRole": profile["Arn"]})
        policy = batch.create_scheduling_policy(name=f"{prefix}-fair-share", fairsharePolicy={
            "shareDecaySeconds": 3600, "computeReservation": 10,
            "shareDistribution": [{"shareIdentifier": "default", "weightFactor": 1.0}]})
        batch.create_job_queue(jobQueueName=queue, state="ENABLED", priority=1, schedulingPolicyArn=policy["arn"],
                               computeEnvironmentOrder=[{"order": 1, "computeEnvironment": environment[
                                   "computeEnvironmentArn"]}])
        spot = batch.create_compute_environment(  # single-node jobs only: Batch runs no multi-node job on spot
            computeEnvironmentName=f"{prefix}-trn1-spot", type="MANAGED", state="ENABLED", serviceRole=service_role,
            computeResources={"type": "SPOT", "allocationStrategy": "SPOT_PRICE_CAPACITY_OPTIMIZED", "minvCpus": 0,
                              "maxvCpus": 2048, "instanceTypes": ["trn1.32xlarge"],
                              "subnets": [subnet], "securityGroupIds": [group], "instanceRole": profile["Arn"]})
        batch.create_job_queue(jobQueueName=f"{queue}-spot", state="ENABLED", priority=1,
                               schedulingPolicyArn=policy["arn"], computeEnvironmentOrder=[
                                   {"order": 1, "computeEnvironment": spot["computeEnvironmentArn"]}])
    secrets = client("secretsmanager")
    try:
        secret = secrets.describe_secret(SecretId=f"{prefix}-cache-signing-key")["ARN"]
    except secrets.exceptions.ResourceNotFoundException:
        secret = secrets.create_secret(Name=f"{prefix}-cache-signing-key", SecretString=signing_pem(prefix))["ARN"]
    outputs = mock_outputs(prefix) | {"CACHE_SIGNING_KEY": secret}
    ssm = client("ssm")
    for name in PUBLISHED:  # as the infra stack publishes them
        ssm.put_parameter(Name=f"/{prefix}/{name.lower().replace('_', '-')}", Value=outputs[name], Type="String",
                          Overwrite=True)
    # a stack declares its teams after (`provision_teams`): none are left from an earlier one on this server
    with contextlib.suppress(ssm.exceptions.ParameterNotFound):
        ssm.delete_parameter(Name=f"/{prefix}/teams")
    return outputs


def mock_outputs(prefix: str = "trnflow") -> dict[str, str]:
    """The settings of the deployment `provision` makes (its names are fixed)."""
    repository = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/{prefix}-train"
    return {"IMAGE_NEURON": f"{repository}:neuron", "IMAGE_XLA": f"{repository}:xla",
            "STAGING_URL": f"s3://{prefix}-staging-{ACCOUNT}/jobs",
            "JOB_POLICIES": f"arn:aws:iam::{ACCOUNT}:policy/{prefix}/", "ROLE_SETTLE_SECONDS": "0",
            "BATCH_JOB_QUEUE": f"{prefix}-trn1", "BATCH_SPOT_JOB_QUEUE": f"{prefix}-trn1-spot",
            "DATA_BUCKET": f"{prefix}-data-{ACCOUNT}",
            "CACHE_PUBLIC_KEY": public_text(signing_key(prefix).public_key())}


TEAMS_KEY = "_operators/teams.yaml"
"""Where `provision_teams` keeps the teams file, in the staging bucket: beside the jobs' folders
(`jobs/...`), which are all a job may write there."""


def team_prefixes(team: str, prefix: str = "trnflow") -> dict[str, str]:
    """A team's folders in the mock deployment, whose one data bucket holds everything (a real stack
    has a bucket a kind: infra/cloudformation/trnflow.yaml's layout, `teams/<team>/` of each)."""
    base = f"s3://{prefix}-data-{ACCOUNT}/teams/{team}"
    return {"checkpoints": f"{base}/checkpoints", "registry": f"{base}/registry", "outputs": f"{base}/embeddings",
            "cache": f"{base}/neuron-cache"}


def provision_teams(client: Any, teams: list[str], prefix: str = "trnflow", quotas: dict[str, int] | None = None
                    ) -> dict[str, dict[str, str]]:
    """Declare `teams` in the deployment `provision` made, as its operators would: a teams file (each
    team's folders under `teams/<team>/`, the seeded `quickstart/` data readable by all, a signing key
    of its own in Secrets Manager, spot capacity of its own, `quotas` when given), published as the
    `teams` setting, and for each team the role its orchestrators run as, tagged with it (what
    infra's team.yaml makes). Returns, by team, the AWS variables of a session of that role (the
    emulator's credentials, good for twelve hours)."""
    iam, sts, secrets, s3, batch = (client(s) for s in ("iam", "sts", "secretsmanager", "s3", "batch"))
    (shared,) = batch.describe_compute_environments(computeEnvironments=[f"{prefix}-trn1-spot"])["computeEnvironments"]
    (shared_queue,) = batch.describe_job_queues(jobQueues=[f"{prefix}-trn1-spot"])["jobQueues"]
    declared, sessions = [], {}
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"}}]}
    for team in teams:
        key = signing_key(f"{prefix}-{team}")
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        name = f"{prefix}/teams/{team}/cache-signing-key"
        try:
            secret = secrets.describe_secret(SecretId=name)["ARN"]
        except secrets.exceptions.ResourceNotFoundException:
            secret = secrets.create_secret(Name=name, SecretString=pem)["ARN"]
        spot = f"{prefix}-{team}-trn1-spot"
        if not batch.describe_job_queues(jobQueues=[spot])["jobQueues"]:
            profile = iam.create_instance_profile(InstanceProfileName=f"{prefix}-{team}-batch-spot-instance")
            resources = {**shared["computeResources"], "instanceRole": profile["InstanceProfile"]["Arn"]}
            environment = batch.create_compute_environment(
                computeEnvironmentName=spot, type="MANAGED", state="ENABLED", serviceRole=shared["serviceRole"],
                computeResources={k: resources[k] for k in ("type", "allocationStrategy", "minvCpus", "maxvCpus",
                                                            "instanceTypes", "subnets", "securityGroupIds",
                                                            "instanceRole")})
            batch.create_job_queue(jobQueueName=spot, state="ENABLED", priority=1,
                                   schedulingPolicyArn=shared_queue["schedulingPolicyArn"], computeEnvironmentOrder=[
                                       {"order": 1, "computeEnvironment": environment["computeEnvironmentArn"]}])
        declared.append({"name": team, **team_prefixes(team, prefix), "read": [f"s3://{prefix}-data-{ACCOUNT}/quickstart"],
                         "cache_signing_key": secret, "cache_public_key": public_text(key.public_key()),
                         "batch_spot_job_queue": spot, **({"quotas": quotas} if quotas else {})})
        role = f"{prefix}-{team}-orchestrator"
        try:
            arn = iam.get_role(RoleName=role)["Role"]["Arn"]
        except iam.exceptions.NoSuchEntityException:
            arn = iam.create_role(RoleName=role, AssumeRolePolicyDocument=json.dumps(trust), MaxSessionDuration=43200,
                                  Tags=[{"Key": "trnflow-team", "Value": team}])["Role"]["Arn"]
        found = sts.assume_role(RoleArn=arn, RoleSessionName="mock-aws", DurationSeconds=43200)["Credentials"]
        sessions[team] = {"AWS_ACCESS_KEY_ID": found["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": found["SecretAccessKey"],
                          "AWS_SESSION_TOKEN": found["SessionToken"]}
    s3.put_object(Bucket=f"{prefix}-staging-{ACCOUNT}", Key=TEAMS_KEY,
                  Body=yaml.safe_dump({"teams": declared}, sort_keys=False).encode())
    client("ssm").put_parameter(Name=f"/{prefix}/teams", Value=f"s3://{prefix}-staging-{ACCOUNT}/{TEAMS_KEY}",
                                Type="String", Overwrite=True)
    return sessions
