"""What each role of the stack can write, read off its policies as IAM evaluates them (an explicit
deny wins; else an allow that matches; else no): each stage kind writes only its own outputs, and
only the orchestrator writes the registry and the `_current.json` pointers. And checkov finds
nothing the template does not skip with a reason."""

import json
import re
import subprocess
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from cfnlint.decode import decode_str

INFRA = Path(__file__).resolve().parents[1]
TEMPLATE = INFRA / "cloudformation" / "trnflow.yaml"
CHECKOV = INFRA.parent / ".venv" / "checkov" / "bin" / "checkov"
PSEUDO = {"AWS::Partition": "aws", "AWS::Region": "us-east-1", "AWS::AccountId": "123456789012",
          "AWS::StackName": "trnflow"}


def _template() -> dict:
    template, errors = decode_str(TEMPLATE.read_text())
    assert not errors, errors
    return json.loads(json.dumps(template))


class Stack:
    """The template's policies with every reference resolved as a deployment with the default
    parameters would resolve it."""

    def __init__(self, template: dict):
        self.resources = template["Resources"]
        self.values = {**PSEUDO, **{k: str(v.get("Default", "")) for k, v in template["Parameters"].items()}}

    def ref(self, name: str) -> str:
        if name in self.values:
            return self.values[name]
        resource = self.resources[name]
        kind, props = resource["Type"], resource.get("Properties", {})
        if kind == "AWS::S3::Bucket":
            return self.resolve(props["BucketName"])
        if kind == "AWS::SecretsManager::Secret":
            return f"arn:aws:secretsmanager:us-east-1:123456789012:secret:{self.resolve(props['Name'])}-AbCdEf"
        if kind == "AWS::Batch::JobQueue":
            return f"arn:aws:batch:us-east-1:123456789012:job-queue/{self.resolve(props['JobQueueName'])}"
        return name

    def attribute(self, name: str, attribute: str) -> str:
        kind, props = self.resources[name]["Type"], self.resources[name].get("Properties", {})
        if kind == "AWS::S3::Bucket":
            return f"arn:aws:s3:::{self.ref(name)}"
        if kind == "AWS::IAM::Role":
            return f"arn:aws:iam::123456789012:role/{self.resolve(props['RoleName'])}"
        return f"{name}.{attribute}"

    def resolve(self, value):
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if not isinstance(value, dict):
            return value
        if "Ref" in value:
            return self.ref(value["Ref"])
        if "Fn::GetAtt" in value:
            return self.attribute(*value["Fn::GetAtt"])
        if "Fn::Sub" in value:
            def one(match):
                name, _, attribute = match.group(1).partition(".")
                return self.attribute(name, attribute) if attribute else self.ref(name)
            return re.sub(r"\$\{([^}]+)\}", one, value["Fn::Sub"])
        return {k: self.resolve(v) for k, v in value.items()}

    def statements(self, role: str) -> list[dict]:
        props = self.resources[role]["Properties"]
        documents = [self.resources[ref["Ref"]]["Properties"]["PolicyDocument"]
                     for ref in props.get("ManagedPolicyArns", []) if isinstance(ref, dict) and "Ref" in ref]
        documents += [p["PolicyDocument"] for p in props.get("Policies", [])]
        return [self.resolve(s) for d in documents for s in d["Statement"]]

    def allows(self, role: str, action: str, resource: str, context: dict[str, str] | None = None) -> bool:
        """Whether `role` may do `action` on `resource`, the request's condition keys being `context`
        (`aws:ResourceTag/<key>`: the resource's tags). A statement's StringEquals condition holds only
        when the key is in the context with one of its values, as IAM evaluates a missing key."""
        context = context or {}

        def holds(statement) -> bool:
            conditions = statement.get("Condition", {})
            unknown = set(conditions) - {"StringEquals", "StringLike"}
            assert not unknown, f"this evaluator reads StringEquals and StringLike only, not {unknown}"

            def listed(wanted):
                return wanted if isinstance(wanted, list) else [wanted]
            return (all(context.get(key) in listed(wanted)
                        for key, wanted in conditions.get("StringEquals", {}).items())
                    and all(key in context and any(fnmatchcase(context[key], w) for w in listed(wanted))
                            for key, wanted in conditions.get("StringLike", {}).items()))

        def matches(statement) -> bool:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            resources = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
            return (any(fnmatchcase(action.lower(), a.lower()) for a in actions)
                    and any(fnmatchcase(resource, r) for r in resources) and holds(statement))
        found = [s for s in self.statements(role) if matches(s)]
        return not any(s["Effect"] == "Deny" for s in found) and any(s["Effect"] == "Allow" for s in found)


STACK = Stack(_template())
CHECKPOINTS, CACHE = "arn:aws:s3:::trnflow-checkpoints-123456789012", "arn:aws:s3:::trnflow-compile-cache-123456789012"
OUTPUTS, STAGING = "arn:aws:s3:::trnflow-outputs-123456789012", "arn:aws:s3:::trnflow-staging-123456789012"
WRITES = {  # what a job or flow of each kind puts, and whether it may
    "checkpoint": f"{CHECKPOINTS}/runs/m/20261128-a1/step-00000100/model.pt",
    "preflight checkpoint": f"{CHECKPOINTS}/runs/m/20261128-a1/_preflight/step-000000/model.pt",
    "registry entry": f"{CHECKPOINTS}/registry/m/versions/v000002.json",
    "champion record": f"{CHECKPOINTS}/registry/m/champion/g000002.json",
    "cache entry": f"{CACHE}/neuronxcc-torch-2.13.0+cpu/MODULE_1+2/model.neff",
    "embeddings": f"{OUTPUTS}/m/v000002/part-00000.parquet",
    "pointer": f"{OUTPUTS}/m/_current.json",
    "result": f"{STAGING}/jobs/r1/m-train-r1/output/result.json",
}
MAY_WRITE = {
    "PreflightJobRole": {"result", "preflight checkpoint"},
    "CompileJobRole": {"result", "cache entry"},
    "TrainJobRole": {"result", "checkpoint", "preflight checkpoint"},
    "InferJobRole": {"result", "embeddings"},
    "OrchestratorRole": {"result", "registry entry", "champion record", "pointer"},
}


@pytest.mark.parametrize("role", sorted(MAY_WRITE))
def test_each_role_writes_only_its_own_outputs(role):
    writes = {what for what, arn in WRITES.items() if STACK.allows(role, "s3:PutObject", arn)}
    assert writes == MAY_WRITE[role]
    deletes = {what for what, arn in WRITES.items() if STACK.allows(role, "s3:DeleteObject", arn)}
    assert deletes <= MAY_WRITE[role]


def test_the_preflight_writes_its_round_trip_checkpoint_and_nothing_of_the_registry():
    # a model named `preflight` is none of the round trip's: its checkpoints and registry entries stay the others'
    assert not STACK.allows("PreflightJobRole", "s3:PutObject", f"{CHECKPOINTS}/registry/preflight/versions/v1.json")
    assert not STACK.allows("PreflightJobRole", "s3:DeleteObject", f"{CHECKPOINTS}/preflight/r1/step-000010/model.pt")
    assert not STACK.allows("PreflightJobRole", "s3:PutObject", WRITES["checkpoint"])


def test_the_training_role_cannot_promote_and_the_inference_role_cannot_poison_the_cache():
    assert not STACK.allows("TrainJobRole", "s3:PutObject", WRITES["registry entry"])
    assert not STACK.allows("InferJobRole", "s3:PutObject", WRITES["cache entry"])
    assert STACK.allows("TrainJobRole", "s3:GetObject", WRITES["cache entry"])  # every job reads the cache


def test_only_the_compile_role_reads_the_signing_key_and_no_job_creates_log_groups():
    secret = STACK.ref("CacheSigningKey")
    readers = {role for role in MAY_WRITE if STACK.allows(role, "secretsmanager:GetSecretValue", secret)}
    assert readers == {"CompileJobRole"}
    group = "arn:aws:logs:us-east-1:123456789012:log-group:/aws/batch/job:log-stream:x"
    for role in MAY_WRITE:
        assert not STACK.allows(role, "logs:CreateLogGroup", "arn:aws:logs:us-east-1:123456789012:log-group:/x")
    assert STACK.allows("TrainJobRole", "logs:PutLogEvents", group)


def test_containers_cannot_reach_the_instances_role_and_logs_are_kept_for_a_while():
    resources = _template()["Resources"]
    options = resources["NodeLaunchTemplate"]["Properties"]["LaunchTemplateData"]["MetadataOptions"]
    assert options == {"HttpTokens": "required", "HttpPutResponseHopLimit": 1}
    assert resources["BatchInstanceRole"]["Properties"]["ManagedPolicyArns"] == [
        {"Fn::Sub": "arn:${AWS::Partition}:iam::aws:policy/service-role/AmazonEC2ContainerServiceforEC2Role"}]
    groups = {r["Properties"]["LogGroupName"]: r["Properties"] for r in resources.values()
              if r["Type"] == "AWS::Logs::LogGroup"}
    assert set(groups) == {"/aws/sagemaker/TrainingJobs", "/aws/batch/job"}
    assert all(g["RetentionInDays"] == {"Ref": "LogRetentionDays"} for g in groups.values())


def test_every_bucket_takes_tls_only():
    resources = _template()["Resources"]
    buckets = {name for name, r in resources.items() if r["Type"] == "AWS::S3::Bucket"}
    guarded = {}
    for r in resources.values():
        if r["Type"] == "AWS::S3::BucketPolicy":
            for s in r["Properties"]["PolicyDocument"]["Statement"]:
                if s["Effect"] == "Deny" and s.get("Condition") == {"Bool": {"aws:SecureTransport": "false"}}:
                    guarded[r["Properties"]["Bucket"]["Ref"]] = s["Action"]
    assert guarded == dict.fromkeys(buckets, "s3:*")


def test_every_checkov_skip_says_why():
    skips = [(name, skip) for name, r in _template()["Resources"].items()
             for skip in r.get("Metadata", {}).get("checkov", {}).get("skip", [])]
    assert skips
    for name, skip in skips:
        assert re.fullmatch(r"CKV_AWS_\d+", skip["id"]) and len(skip.get("comment", "")) > 30, (name, skip)


@pytest.mark.skipif(not CHECKOV.exists(), reason="checkov's own venv is made by `make test` (make checkov)")
def test_checkov_passes_the_template():
    result = subprocess.run([str(CHECKOV), "--framework", "cloudformation", "-f", str(TEMPLATE), "--compact",
                             "--quiet", "--skip-download", "--output", "json"], capture_output=True, text=True,
                            timeout=300)
    report = json.loads(result.stdout)
    failed = [(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]]
    assert result.returncode == 0 and not failed, failed


def test_only_the_orchestrator_terminates_instances_and_only_the_compute_environments():
    """An instance that failed a job's preflight is terminated by the orchestrator, so that Batch's
    retry runs on another; the role can terminate no other instance, and no job can terminate any."""
    instance = "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0"
    ours = {"aws:ResourceTag/trnflow:compute-environment": "trnflow-trn1"}
    tags = STACK.resolve(STACK.resources["ComputeEnvironment"]["Properties"]["ComputeResources"]["Tags"])
    assert {f"aws:ResourceTag/{k}": v for k, v in tags.items()} == ours  # Batch tags its instances so
    assert STACK.allows("OrchestratorRole", "ec2:TerminateInstances", instance, ours)
    spot = {"aws:ResourceTag/trnflow:compute-environment": "trnflow-trn1-spot"}
    spot_tags = STACK.resolve(STACK.resources["SpotComputeEnvironment"]["Properties"]["ComputeResources"]["Tags"])
    assert {f"aws:ResourceTag/{k}": v for k, v in spot_tags.items()} == spot
    assert STACK.allows("OrchestratorRole", "ec2:TerminateInstances", instance, spot)
    assert not STACK.allows("OrchestratorRole", "ec2:TerminateInstances", instance)  # anyone else's instance
    assert not STACK.allows("OrchestratorRole", "ec2:TerminateInstances", instance,
                            {"aws:ResourceTag/trnflow:compute-environment": "another-trn1"})
    for role in ("PreflightJobRole", "CompileJobRole", "TrainJobRole", "InferJobRole", "BatchInstanceRole"):
        assert not STACK.allows(role, "ec2:TerminateInstances", instance, ours), role
    assert STACK.allows("OrchestratorRole", "ec2:DescribeInstances", "*")  # each node's launch, for the bill
    assert STACK.allows("OrchestratorRole", "ec2:DescribeSpotPriceHistory", "*")  # and a spot job's price


def test_the_orchestrator_stops_only_trnflows_jobs_and_reads_where_their_nodes_ran():
    """TerminateJob reaches only jobs tagged with a trnflow run (every job it submits is); and to
    replace a bad node it reads the job's own placement from ECS, never a node's word."""
    job = "arn:aws:batch:us-east-1:123456789012:job/5d9e1b2c-0000-4000-8000-000000000000"
    assert STACK.allows("OrchestratorRole", "batch:TerminateJob", job, {"aws:ResourceTag/trnflow:run-id": "r1"})
    assert not STACK.allows("OrchestratorRole", "batch:TerminateJob", job)  # another team's untagged job
    assert not STACK.allows("OrchestratorRole", "batch:TerminateJob", job, {"aws:ResourceTag/trnflow:run-id": ""})
    instance = "arn:aws:ecs:us-east-1:123456789012:container-instance/OnDemand_Batch_x/0f1e2d3c"
    assert STACK.allows("OrchestratorRole", "ecs:DescribeContainerInstances", instance)
    assert STACK.allows("OrchestratorRole", "batch:DescribeComputeEnvironments", "*")
    for role in ("PreflightJobRole", "CompileJobRole", "TrainJobRole", "InferJobRole"):
        assert not STACK.allows(role, "batch:TerminateJob", job, {"aws:ResourceTag/trnflow:run-id": "r1"}), role
