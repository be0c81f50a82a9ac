"""What each role of the stack can write, read off its policies as IAM evaluates them (an explicit
deny wins; else an allow that matches; else no): each job writes only its own run's outputs of its
stage kind, and only the orchestrator writes the registry and the `_current.json` pointers. And
checkov finds nothing the template does not skip with a reason.

Jobs run as roles the orchestrator makes for each (`trnflow.backends.run_roles`): their policies are
the stack's JobBasePolicy and their kind's, their tags the folders `JobScope` gives them. A job is
evaluated here as those policies with those tags, `${aws:PrincipalTag/...}` filled in from them."""

import json
import os
import re
import subprocess
import time
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from cfnlint.decode import decode_str

from trnflow.settings import JOB_KINDS

INFRA = Path(__file__).resolve().parents[1]
TEMPLATE = INFRA / "cloudformation" / "trnflow.yaml"
TEAM_TEMPLATE = INFRA / "cloudformation" / "team.yaml"
CHECKOV = INFRA.parent / ".venv" / "checkov" / "bin" / "checkov"
BESIDE = os.environ.get("TRNFLOW_TEST_CHECKOV_BESIDE") == "yes"  # its venv is being made beside the tests
PSEUDO = {"AWS::Partition": "aws", "AWS::Region": "us-east-1", "AWS::AccountId": "123456789012",
          "AWS::StackName": "trnflow"}


def _template(path: Path = TEMPLATE) -> dict:
    template, errors = decode_str(path.read_text())
    assert not errors, errors
    return json.loads(json.dumps(template))


class Stack:
    """The template's policies with every reference resolved as a deployment with the default
    parameters (and `parameters`) would resolve it."""

    def __init__(self, template: dict, parameters: dict[str, str] | None = None):
        self.resources = template["Resources"]
        self.values = {**PSEUDO, **{k: str(v.get("Default", "")) for k, v in template["Parameters"].items()},
                       **(parameters or {})}

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
        if kind == "AWS::IAM::ManagedPolicy":
            path, name = self.resolve(props["Path"]), self.resolve(props["ManagedPolicyName"])
            return f"arn:aws:iam::123456789012:policy{path}{name}"
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
        if "Fn::Select" in value:
            index, items = value["Fn::Select"]
            return self.resolve(items)[int(index)]
        if "Fn::Split" in value:
            separator, text = value["Fn::Split"]
            return self.resolve(text).split(separator)
        if "Fn::Sub" in value:
            text, names = (value["Fn::Sub"], {}) if isinstance(value["Fn::Sub"], str) else value["Fn::Sub"]
            names = {k: self.resolve(v) for k, v in names.items()}

            def one(match):
                if match.group(1):  # ${!name}: the text ${name}, for IAM to fill in
                    return "${" + match.group(2) + "}"
                if match.group(2) in names:
                    return names[match.group(2)]
                name, _, attribute = match.group(2).partition(".")
                return self.attribute(name, attribute) if attribute else self.ref(name)
            return re.sub(r"\$\{(!?)([^}]+)\}", one, text)
        return {k: self.resolve(v) for k, v in value.items()}

    def statements(self, role: str) -> list[dict]:
        """The statements of the stack's role `role`, or of a job of stage kind `role` (`train`)."""
        if role in JOB_POLICIES:
            return [self.resolve(s) for name in ("JobBasePolicy", JOB_POLICIES[role])
                    for s in self.resources[name]["Properties"]["PolicyDocument"]["Statement"]]
        props = self.resources[role]["Properties"]
        documents = [self.resources[ref["Ref"]]["Properties"]["PolicyDocument"]
                     for ref in props.get("ManagedPolicyArns", []) if isinstance(ref, dict) and "Ref" in ref]
        documents += [p["PolicyDocument"] for p in props.get("Policies", [])]
        return [self.resolve(s) for d in documents for s in d["Statement"]]

    def allows(self, role: str, action: str, resource: str, context: dict[str, str] | None = None) -> bool:
        """Whether `role` may do `action` on `resource`, the request's condition keys being `context`
        (`aws:ResourceTag/<key>`: the resource's tags; `aws:PrincipalTag/<key>`: the role's own;
        `s3:prefix`: a listing's). A statement's StringEquals condition holds only when the key is in
        the context with one of its values, as IAM evaluates a missing key; a pattern naming a policy
        variable the context lacks matches nothing, as in IAM."""
        context = context or {}

        def filled(pattern: str) -> str | None:
            names = re.findall(r"\$\{([^}]+)\}", pattern)
            if any(name not in context for name in names):
                return None
            return re.sub(r"\$\{([^}]+)\}", lambda m: context[m.group(1)], pattern)

        def listed(wanted) -> list[str]:
            return [p for p in (filled(w) for w in (wanted if isinstance(wanted, list) else [wanted])) if p is not None]

        def holds(statement) -> bool:
            conditions = statement.get("Condition", {})
            unknown = set(conditions) - {"StringEquals", "StringLike", "StringNotEquals", "StringNotLike",
                                         "StringEqualsIfExists", "Null"}
            assert not unknown, f"this evaluator reads the String conditions only, not {unknown}"
            return (all(context.get(key) in listed(wanted)
                        for key, wanted in conditions.get("StringEquals", {}).items())
                    and all(key not in context or context[key] in listed(wanted)
                            for key, wanted in conditions.get("StringEqualsIfExists", {}).items())
                    # Null: "true" holds where the key is missing, "false" where it is there
                    and all((key not in context) == (wanted == "true")
                            for key, wanted in conditions.get("Null", {}).items())
                    and all(key in context and any(fnmatchcase(context[key], w) for w in listed(wanted))
                            for key, wanted in conditions.get("StringLike", {}).items())
                    # a negated operator holds where the key is missing, as IAM evaluates it
                    and all(context.get(key) not in listed(wanted)
                            for key, wanted in conditions.get("StringNotEquals", {}).items())
                    and all(key not in context or not any(fnmatchcase(context[key], w) for w in listed(wanted))
                            for key, wanted in conditions.get("StringNotLike", {}).items()))

        def matches(statement) -> bool:
            actions = statement["Action"] if isinstance(statement["Action"], list) else [statement["Action"]]
            if "NotResource" in statement:  # every resource but those (a pattern whose variable is missing: none)
                where = not any(fnmatchcase(resource, r) for r in listed(statement["NotResource"]))
            else:
                where = any(fnmatchcase(resource, r) for r in listed(statement["Resource"]))
            return any(fnmatchcase(action.lower(), a.lower()) for a in actions) and where and holds(statement)
        found = [s for s in self.statements(role) if matches(s)]
        return not any(s["Effect"] == "Deny" for s in found) and any(s["Effect"] == "Allow" for s in found)


JOB_POLICIES = {kind: f"Job{kind.title()}Policy" for kind in JOB_KINDS}
"""Each stage kind's policy, which a job of that kind has beside JobBasePolicy."""
STACK = Stack(_template())
CHECKPOINTS, CACHE = "arn:aws:s3:::trnflow-checkpoints-123456789012", "arn:aws:s3:::trnflow-compile-cache-123456789012"
OUTPUTS, STAGING = "arn:aws:s3:::trnflow-outputs-123456789012", "arn:aws:s3:::trnflow-staging-123456789012"
RUN, OTHER = "20261128T101500-a1", "20261128T101700-b2"


def job(kind: str, run: str = RUN, team: str = "default") -> dict[str, str]:
    """The condition keys of a request by a `kind` job of `run` of model `m` (version 2's inference):
    its role's tags, as the orchestrator gives them (`JobScope.tags`). A declared team's run keeps
    its folders under the team's (`teams/<team>/`, `jobs/<team>/`); the default team's where it likes."""
    from trnflow.backends.run_roles import JobScope

    under = "" if team == "default" else f"teams/{team}/"
    writes = {"preflight": f"s3://trnflow-checkpoints-123456789012/{under}runs/m/{run}",
              "train": f"s3://trnflow-checkpoints-123456789012/{under}runs/m/{run}",
              "infer": f"s3://trnflow-outputs-123456789012/{under}m/v000002"}.get(kind)
    staging = f"s3://trnflow-staging-123456789012/jobs/{'' if team == 'default' else team + '/'}{run}"
    scope = JobScope(kind=kind, run_id=run, staging=staging, writes=writes, team=team, job=f"m-{kind}-{run}")
    return {f"aws:PrincipalTag/{key}": value for key, value in scope.tags(expires=0).items()}


WRITES = {  # what a job or flow of each kind puts, and whether it may
    "checkpoint": f"{CHECKPOINTS}/runs/m/{RUN}/step-00000100/model.pt",
    "preflight checkpoint": f"{CHECKPOINTS}/runs/m/{RUN}/_preflight/step-000000/model.pt",
    "registry entry": f"{CHECKPOINTS}/registry/m/versions/v000002.json",
    "champion record": f"{CHECKPOINTS}/registry/m/champion/g000002.json",
    "cache entry": f"{CACHE}/neuronxcc-torch-2.13.0+cpu/MODULE_1+2/model.neff",
    "embeddings": f"{OUTPUTS}/m/v000002/part-00000.parquet",
    "pointer": f"{OUTPUTS}/m/_current.json",
    "result": f"{STAGING}/jobs/{RUN}/m-train-{RUN}/output/result.json",
    "event file": f"{CHECKPOINTS}/runs/m/{RUN}/tensorboard/events.out.tfevents.{RUN}.trnflow",
}
MAY_WRITE = {
    "preflight": {"result", "preflight checkpoint"},
    "compile": {"result", "cache entry"},
    "train": {"result", "checkpoint", "preflight checkpoint", "event file"},  # its own run's folder
    "infer": {"result", "embeddings"},
    "OrchestratorRole": {"result", "registry entry", "champion record", "pointer", "event file"},
}


def _as(principal: str) -> dict[str, str]:
    return job(principal) if principal in JOB_POLICIES else {}


@pytest.mark.parametrize("principal", sorted(MAY_WRITE))
def test_each_job_and_the_orchestrator_write_only_their_own_outputs(principal):
    context = _as(principal)
    writes = {what for what, arn in WRITES.items() if STACK.allows(principal, "s3:PutObject", arn, context)}
    assert writes == MAY_WRITE[principal]
    deletes = {what for what, arn in WRITES.items() if STACK.allows(principal, "s3:DeleteObject", arn, context)}
    assert deletes <= MAY_WRITE[principal]


@pytest.mark.parametrize("kind", sorted(JOB_POLICIES))
def test_a_job_of_one_run_cannot_write_anything_of_another_run(kind):
    """Issue 54: run A's job cannot overwrite run B's result (what the gate judges), its nodes' failure
    reports, the orchestrator's word to its nodes, its checkpoints or its spec; nor list B's staging.
    It can still read B's checkpoints (a champion another run trained is an input)."""
    theirs = [f"{STAGING}/jobs/{OTHER}/m-train-{OTHER}/output/result.json",
              f"{STAGING}/jobs/{OTHER}/m-train-{OTHER}/output/j1/failure-node1.json",
              f"{STAGING}/jobs/{OTHER}/m-train-{OTHER}/output/j1/proceed-train.json",
              f"{STAGING}/jobs/{OTHER}/m-train-{OTHER}/input/spec.json",
              f"{CHECKPOINTS}/runs/m/{OTHER}/step-00000100/model.pt",
              f"{CHECKPOINTS}/runs/m/{OTHER}/step-00000100/COMMITTED",
              f"{CHECKPOINTS}/runs/m/{OTHER}/_preflight/step-000000/model.pt",
              f"{CHECKPOINTS}/runs/m/{RUN}-x/step-00000100/model.pt",  # a run whose id starts as A's does
              f"{OUTPUTS}/m/v000001/part-00000.parquet", f"{OUTPUTS}/m/v0000020/part-00000.parquet"]
    mine = job(kind)
    for arn in theirs:
        for action in ("s3:PutObject", "s3:DeleteObject"):
            assert not STACK.allows(kind, action, arn, mine), (kind, action, arn)
    assert not STACK.allows(kind, "s3:GetObject", theirs[0], mine)  # nor read B's results
    assert not STACK.allows(kind, "s3:ListBucket", STAGING, mine | {"s3:prefix": f"jobs/{OTHER}/"})
    assert STACK.allows(kind, "s3:ListBucket", STAGING, mine | {"s3:prefix": f"jobs/{RUN}/m-train-{RUN}/"})
    assert STACK.allows(kind, "s3:GetObject", theirs[4], mine)
    # B's own job of the same kind writes there: the difference is the tags alone
    assert STACK.allows(kind, "s3:PutObject", theirs[0], job(kind, OTHER))


@pytest.mark.parametrize("kind", sorted(JOB_POLICIES))
def test_a_job_role_without_the_runs_tags_writes_nothing(kind):
    """Fails closed: a role missing its tags (made by hand, say) writes nothing, not even the cache (it
    has no team)."""
    assert {what for what, arn in WRITES.items() if STACK.allows(kind, "s3:PutObject", arn)} == set()


def test_no_job_can_touch_its_roles_tags_or_policies_and_the_orchestrator_only_makes_job_roles():
    role = "arn:aws:iam::123456789012:role/trnflow/trnflow-run-train-0123456789abcdef"
    for kind in JOB_POLICIES:
        for action in ("iam:TagRole", "iam:UntagRole", "iam:AttachRolePolicy", "iam:PutRolePolicy", "iam:CreateRole",
                       "iam:PassRole", "sts:TagSession"):
            assert not STACK.allows(kind, action, role, job(kind)), (kind, action)
    tagged = {"aws:RequestTag/trnflow-run": RUN, "aws:RequestTag/trnflow-team": "default",
              "aws:PrincipalTag/trnflow-team": "default"}
    assert STACK.allows("OrchestratorRole", "iam:CreateRole", role, tagged)
    assert not STACK.allows("OrchestratorRole", "iam:CreateRole", role)  # untagged: no run, so no scope
    assert not STACK.allows("OrchestratorRole", "iam:CreateRole", "arn:aws:iam::123456789012:role/admin", tagged)
    assert not STACK.allows("OrchestratorRole", "iam:PutRolePolicy", role)  # no policy of its own making
    ours = {"aws:PrincipalTag/trnflow-team": "default", "iam:ResourceTag/trnflow-team": "default"}
    for name in ("JobBasePolicy", *JOB_POLICIES.values()):
        assert STACK.allows("OrchestratorRole", "iam:AttachRolePolicy", role, ours | {"iam:PolicyARN": STACK.ref(name)})
    assert not STACK.allows("OrchestratorRole", "iam:AttachRolePolicy", role,
                            ours | {"iam:PolicyARN": "arn:aws:iam::aws:policy/AdministratorAccess"})
    passed = ours | {"iam:PassedToService": "sagemaker.amazonaws.com"}
    assert STACK.allows("OrchestratorRole", "iam:PassRole", role, passed)
    assert not STACK.allows("OrchestratorRole", "iam:PassRole", "arn:aws:iam::123456789012:role/trnflow-orchestrator",
                            passed)
    assert STACK.allows("OrchestratorRole", "iam:DeleteRole", role, ours)
    assert not STACK.allows("OrchestratorRole", "iam:DeleteRole", "arn:aws:iam::123456789012:role/trnflow-orchestrator",
                            ours)


def test_the_preflight_writes_its_round_trip_checkpoint_and_nothing_of_the_registry():
    # a model named `preflight` is none of the round trip's: its checkpoints and registry entries stay the others'
    mine = job("preflight")
    assert not STACK.allows("preflight", "s3:PutObject", f"{CHECKPOINTS}/registry/preflight/versions/v1.json", mine)
    assert not STACK.allows("preflight", "s3:DeleteObject", f"{CHECKPOINTS}/preflight/r1/step-000010/model.pt", mine)
    assert not STACK.allows("preflight", "s3:PutObject", WRITES["checkpoint"], mine)


def test_the_training_job_cannot_promote_and_the_inference_job_cannot_poison_the_cache():
    assert not STACK.allows("train", "s3:PutObject", WRITES["registry entry"], job("train"))
    registry_run = job("train") | {"aws:PrincipalTag/trnflow-writes": "registry/m"}  # even tagged so by mistake
    assert not STACK.allows("train", "s3:PutObject", WRITES["registry entry"], registry_run)
    assert not STACK.allows("infer", "s3:PutObject", WRITES["cache entry"], job("infer"))
    assert STACK.allows("train", "s3:GetObject", WRITES["cache entry"], job("train"))  # every job reads the cache


def test_only_the_compile_job_reads_the_signing_key_and_no_job_creates_log_groups():
    secret = STACK.ref("CacheSigningKey")
    readers = {p for p in MAY_WRITE if STACK.allows(p, "secretsmanager:GetSecretValue", secret, _as(p))}
    assert readers == {"compile"}
    for principal in MAY_WRITE:
        assert not STACK.allows(principal, "logs:CreateLogGroup", "arn:aws:logs:us-east-1:123456789012:log-group:/x",
                                _as(principal))


LOGS = "arn:aws:logs:us-east-1:123456789012:log-group:"


@pytest.mark.parametrize("kind", sorted(JOB_POLICIES))
def test_a_job_writes_its_own_log_streams_alone(kind):
    """A SageMaker job writes `<its base name>-<time>/algo-...`; no job writes another's stream (whose
    lines trnflow relays: a forged `late` event would put another run in DeadlineAtRisk), nor any
    Batch stream, which its node's ECS agent writes."""
    mine = job(kind)
    own = f"{LOGS}/aws/sagemaker/TrainingJobs:log-stream:m-{kind}-{RUN}-20261205120000/algo-1-1733400000"
    assert STACK.allows(kind, "logs:PutLogEvents", own, mine) and STACK.allows(kind, "logs:CreateLogStream", own, mine)
    for other in (f"m-{kind}-{OTHER}-20261205120000/algo-1-1733400000",
                  f"m-{kind}-{RUN}-x-20261205120000/algo-1-1733400000"):  # a run whose id starts as A's does
        stream = f"{LOGS}/aws/sagemaker/TrainingJobs:log-stream:{other}"
        assert not STACK.allows(kind, "logs:PutLogEvents", stream, mine)
    assert not STACK.allows(kind, "logs:PutLogEvents", f"{LOGS}/aws/batch/job:log-stream:trnflow-x/default/0f1e",
                            mine)


# --- a declared team's jobs reach only its own folders ------------------------------------------------

DATA = "arn:aws:s3:::trnflow-data-123456789012"


@pytest.mark.parametrize("kind", sorted(JOB_POLICIES))
def test_a_job_of_one_team_can_neither_read_nor_write_another_teams_folders_or_key(kind):
    """Team A's job, whatever its kind: none of team B's data, checkpoints, registry, cache, outputs or
    staging, to read or to write, and not B's signing key; its own team's it reads as before."""
    mine = job(kind, team="search")
    theirs = [f"{DATA}/teams/ads/clicks/2026-12-01/part-0.parquet",
              f"{CHECKPOINTS}/teams/ads/runs/m/{OTHER}/step-00000100/model.pt",
              f"{CHECKPOINTS}/registry/ads/m/versions/v000001.json",
              f"{CACHE}/teams/ads/neuronxcc-torch-2.13.0+cpu/MODULE_1+2/model.neff",
              f"{OUTPUTS}/teams/ads/m/v000001/part-00000.parquet",
              f"{STAGING}/jobs/ads/{OTHER}/m-train-{OTHER}/output/result.json",
              f"{CHECKPOINTS}/runs/m/{OTHER}/step-00000100/model.pt",  # the default team's, outside every team's
              f"{CACHE}/neuronxcc-torch-2.13.0+cpu/MODULE_1+2/model.neff"]
    for arn in theirs:
        for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
            assert not STACK.allows(kind, action, arn, mine), (kind, action, arn)
    ours = [f"{DATA}/teams/search/clicks/2026-12-01/part-0.parquet", f"{DATA}/shared/vocab.txt",
            f"{CHECKPOINTS}/teams/search/runs/m/{OTHER}/step-00000100/model.pt",
            f"{CHECKPOINTS}/registry/search/m/versions/v000001.json",
            f"{CACHE}/teams/search/neuronxcc-torch-2.13.0+cpu/MODULE_1+2/model.neff"]
    assert all(STACK.allows(kind, "s3:GetObject", arn, mine) for arn in ours), kind
    for bucket in (DATA, CHECKPOINTS, CACHE, OUTPUTS, STAGING):  # nor list B's keys
        for prefix in ("teams/ads/", "registry/ads/", "jobs/ads/", ""):
            assert not STACK.allows(kind, "s3:ListBucket", bucket, mine | {"s3:prefix": prefix}), (bucket, prefix)
    assert STACK.allows(kind, "s3:ListBucket", CHECKPOINTS, mine | {"s3:prefix": f"teams/search/runs/m/{RUN}/"})
    key = "arn:aws:secretsmanager:us-east-1:123456789012:secret:trnflow/teams/{}/cache-signing-key-AbCdEf"
    assert not STACK.allows(kind, "secretsmanager:GetSecretValue", key.format("ads"), mine)
    assert not STACK.allows(kind, "secretsmanager:GetSecretValue", STACK.ref("CacheSigningKey"), mine)
    assert STACK.allows(kind, "secretsmanager:GetSecretValue", key.format("search"), mine) is (kind == "compile")


def test_a_teams_jobs_write_what_their_kind_writes_inside_the_team_alone():
    search = {"checkpoint": f"{CHECKPOINTS}/teams/search/runs/m/{RUN}/step-00000100/model.pt",
              "cache entry": f"{CACHE}/teams/search/neuronxcc-torch-2.13.0+cpu/MODULE_1+2/model.neff",
              "embeddings": f"{OUTPUTS}/teams/search/m/v000002/part-00000.parquet",
              "result": f"{STAGING}/jobs/search/{RUN}/m-train-{RUN}/output/result.json",
              "registry entry": f"{CHECKPOINTS}/registry/search/m/versions/v000002.json"}
    for kind in JOB_POLICIES:
        writes = {w for w, arn in search.items() if STACK.allows(kind, "s3:PutObject", arn, job(kind, team="search"))}
        assert writes == MAY_WRITE[kind] & set(search), kind
    untagged = {k: v for k, v in job("train", team="search").items() if k != "aws:PrincipalTag/trnflow-team"}
    assert not STACK.allows("train", "s3:GetObject", f"{DATA}/teams/search/x.parquet", untagged)  # fails closed


def test_the_orchestrator_makes_job_roles_of_its_own_team_alone():
    role = "arn:aws:iam::123456789012:role/trnflow/trnflow-run-train-0123456789abcdef"
    orchestrator = {"aws:PrincipalTag/trnflow-team": "default", "aws:RequestTag/trnflow-run": RUN}
    assert STACK.allows("OrchestratorRole", "iam:CreateRole", role, orchestrator | {"aws:RequestTag/trnflow-team":
                                                                                     "default"})
    assert not STACK.allows("OrchestratorRole", "iam:CreateRole", role, orchestrator | {
        "aws:RequestTag/trnflow-team": "ads"})
    assert not STACK.allows("OrchestratorRole", "iam:CreateRole", role, orchestrator)  # no team tag: no role
    tags = {t["Key"]: t["Value"] for t in STACK.resources["OrchestratorRole"]["Properties"]["Tags"]}
    assert tags == {"trnflow-team": "default"}
    itself = "arn:aws:iam::123456789012:role/trnflow-orchestrator"
    assert STACK.allows("OrchestratorRole", "iam:ListRoleTags", itself)  # how it learns its team


# --- a team's own stack (team.yaml): its orchestrator and its spot capacity ----------------------------

TEAM_STACK = Stack(_template(TEAM_TEMPLATE), {"Team": "search", "TeamsFile": "s3://trnflow-ops-123456789012/teams.yaml"})
SEARCH = {"aws:PrincipalTag/trnflow-team": "search"}  # its orchestrator's tag, as the template gives it
JOB_ROLE = "arn:aws:iam::123456789012:role/trnflow/trnflow-run-train-0123456789abcdef"


def test_a_teams_orchestrator_is_tagged_with_its_team_and_may_do_what_the_stacks_may_no_more():
    tags = {t["Key"]: TEAM_STACK.resolve(t["Value"])
            for t in TEAM_STACK.resources["OrchestratorRole"]["Properties"]["Tags"]}
    assert tags == {"trnflow-team": "search"}

    def actions(stack: Stack) -> set[str]:
        return {a for st in stack.statements("OrchestratorRole")
                for a in (st["Action"] if isinstance(st["Action"], list) else [st["Action"]])}
    assert actions(TEAM_STACK) - {"s3:GetObject"} == actions(STACK) - {"s3:GetObject"}
    rule = _template(TEAM_TEMPLATE)["Rules"]["NeverDefault"]["Assertions"][0]["Assert"]
    assert rule == {"Fn::Not": [{"Fn::Equals": [{"Ref": "Team"}, "default"]}]}  # never the stack's own team


def test_a_teams_orchestrator_reads_and_writes_its_own_teams_folders_alone():
    """Team search's orchestrator: its registry, staging, pointers and event files, never team ads's nor
    the stack's own team's; and it reads none of ads's checkpoints, cache or outputs."""
    ours = {"registry entry": f"{CHECKPOINTS}/registry/search/m/versions/v000002.json",
            "result": f"{STAGING}/jobs/search/{RUN}/m-train-{RUN}/output/result.json",
            "pointer": f"{OUTPUTS}/teams/search/m/_current.json",
            "event file": f"{CHECKPOINTS}/teams/search/runs/m/{RUN}/tensorboard/events.out.tfevents.1.trnflow"}
    for what, arn in ours.items():
        assert TEAM_STACK.allows("OrchestratorRole", "s3:PutObject", arn, SEARCH), what
        theirs = arn.replace("/search/", "/ads/")
        assert not TEAM_STACK.allows("OrchestratorRole", "s3:PutObject", theirs, SEARCH), what
        assert not TEAM_STACK.allows("OrchestratorRole", "s3:GetObject", theirs, SEARCH), what
    stacks_team = (WRITES["registry entry"], WRITES["pointer"], WRITES["result"], WRITES["checkpoint"])
    for arn in stacks_team:
        assert not TEAM_STACK.allows("OrchestratorRole", "s3:PutObject", arn, SEARCH), arn
    for arn in (f"{CHECKPOINTS}/teams/ads/runs/m/{RUN}/step-00000100/model.pt", f"{DATA}/teams/ads/x.parquet",
                f"{CACHE}/teams/ads/neuronxcc/MODULE_1+2/model.neff", f"{OUTPUTS}/teams/ads/m/v1/part-0.parquet"):
        assert not TEAM_STACK.allows("OrchestratorRole", "s3:GetObject", arn, SEARCH), arn
        assert TEAM_STACK.allows("OrchestratorRole", "s3:GetObject", arn.replace("/ads/", "/search/"), SEARCH), arn
    assert TEAM_STACK.allows("OrchestratorRole", "s3:GetObject", "arn:aws:s3:::trnflow-ops-123456789012/teams.yaml")
    for prefix, allowed in (("teams/search/runs/", True), ("registry/search/m/", True), ("teams/ads/", False),
                            ("registry/ads/", False), ("", False)):
        assert TEAM_STACK.allows("OrchestratorRole", "s3:ListBucket", CHECKPOINTS, SEARCH | {"s3:prefix": prefix}
                                 ) is allowed, prefix


def test_a_teams_orchestrator_makes_passes_and_deletes_its_own_teams_job_roles_alone():
    """Another team's job role is never changed, passed to a job, re-tagged or deleted by it; a role of
    its own team it makes, gives the stack's job policies, passes and deletes."""
    base = "arn:aws:iam::123456789012:policy/trnflow/job-base"
    for stack, team in ((TEAM_STACK, "search"), (STACK, "default")):
        me = {"aws:PrincipalTag/trnflow-team": team}
        for owner, allowed in ((team, True), ("ads", False)):
            on = me | {"iam:ResourceTag/trnflow-team": owner}
            assert stack.allows("OrchestratorRole", "iam:PassRole", JOB_ROLE, on | {
                "iam:PassedToService": "batch.amazonaws.com"}) is allowed, (team, owner)
            assert stack.allows("OrchestratorRole", "iam:AttachRolePolicy", JOB_ROLE,
                                on | {"iam:PolicyARN": base}) is allowed
            assert stack.allows("OrchestratorRole", "iam:DetachRolePolicy", JOB_ROLE,
                                on | {"iam:PolicyARN": base}) is allowed
            assert stack.allows("OrchestratorRole", "iam:DeleteRole", JOB_ROLE, on) is allowed
            made = on | {"iam:ResourceTag/trnflow-run": OTHER}  # a role trnflow made keeps its team, even its own
            for action in ("iam:TagRole", "iam:UntagRole"):
                assert not stack.allows("OrchestratorRole", action, JOB_ROLE, made | {
                    "aws:RequestTag/trnflow-run": RUN, "aws:RequestTag/trnflow-team": team}), (team, owner)
            assert stack.allows("OrchestratorRole", "iam:ListRoleTags", JOB_ROLE, on)  # a sweep reads every tag
        new = me | {"aws:RequestTag/trnflow-run": RUN}  # a role being made: no tags of its own yet
        for action in ("iam:CreateRole", "iam:TagRole"):
            assert stack.allows("OrchestratorRole", action, JOB_ROLE, new | {"aws:RequestTag/trnflow-team": team})
            assert not stack.allows("OrchestratorRole", action, JOB_ROLE, new | {"aws:RequestTag/trnflow-team": "ads"})
        for action in ("iam:PassRole", "iam:DeleteRole"):  # a role of no team (made by hand): nobody's
            assert not stack.allows("OrchestratorRole", action, JOB_ROLE, me | {
                "iam:PassedToService": "batch.amazonaws.com"}), (team, action)


def test_a_teams_orchestrator_stops_its_own_teams_jobs_and_replaces_its_own_nodes_alone():
    job_arn = "arn:aws:batch:us-east-1:123456789012:job/5d9e1b2c-0000-4000-8000-000000000000"
    training = "arn:aws:sagemaker:us-east-1:123456789012:training-job/m-train-r1"
    for owner, allowed in (("search", True), ("ads", False)):
        on = SEARCH | {"aws:ResourceTag/trnflow-team": owner, "aws:ResourceTag/trnflow:run-id": "r1"}
        assert TEAM_STACK.allows("OrchestratorRole", "batch:TerminateJob", job_arn, on) is allowed
        assert TEAM_STACK.allows("OrchestratorRole", "sagemaker:StopTrainingJob", training, on) is allowed
    instance = "arn:aws:ec2:us-east-1:123456789012:instance/i-0123456789abcdef0"
    for environment, allowed in (("trnflow-trn1", True), ("trnflow-search-trn1-spot", True),
                                 ("trnflow-ads-trn1-spot", False), ("trnflow-trn1-spot", False)):
        assert TEAM_STACK.allows("OrchestratorRole", "ec2:TerminateInstances", instance, {
            "aws:ResourceTag/trnflow:compute-environment": environment}) is allowed, environment
    for resource in (training, job_arn):  # tagged as it is made, with its own team alone; never re-tagged
        action = "sagemaker:AddTags" if "sagemaker" in resource else "batch:TagResource"
        made = SEARCH | {"aws:RequestTag/trnflow-team": "search"}
        assert TEAM_STACK.allows("OrchestratorRole", action, resource, made)
        assert not TEAM_STACK.allows("OrchestratorRole", action, resource, SEARCH | {
            "aws:RequestTag/trnflow-team": "ads"})
        assert not TEAM_STACK.allows("OrchestratorRole", action, resource, SEARCH | {
            "aws:RequestTag/trnflow-team": "search", "aws:ResourceTag/trnflow-team": "ads"}), action
        assert not STACK.allows("OrchestratorRole", action, resource, {
            "aws:PrincipalTag/trnflow-team": "default", "aws:RequestTag/trnflow-team": "default",
            "aws:ResourceTag/trnflow-team": "search"}), action
    # Batch checks a definition's role when it is registered, not when a job is submitted with it: a team
    # submits, registers and removes its own definitions alone, which alone name its job roles
    definition = "arn:aws:batch:us-east-1:123456789012:job-definition/trnflow-{}_m-0123456789ab:1"
    for action in ("batch:SubmitJob", "batch:RegisterJobDefinition", "batch:DeregisterJobDefinition"):
        assert TEAM_STACK.allows("OrchestratorRole", action, definition.format("search"), SEARCH), action
        for other in ("ads", "search-ads"):
            assert not TEAM_STACK.allows("OrchestratorRole", action, definition.format(other), SEARCH), action
        assert not STACK.allows("OrchestratorRole", action, definition.format("search"), {
            "aws:PrincipalTag/trnflow-team": "default"}), action
        assert STACK.allows("OrchestratorRole", action,
                            "arn:aws:batch:us-east-1:123456789012:job-definition/trnflow-m-0123456789ab:1")
    queue = "arn:aws:batch:us-east-1:123456789012:job-queue/{}"
    assert TEAM_STACK.allows("OrchestratorRole", "batch:SubmitJob", queue.format("trnflow-search-trn1-spot"))
    assert TEAM_STACK.allows("OrchestratorRole", "batch:SubmitJob", queue.format("trnflow-trn1"))
    assert not TEAM_STACK.allows("OrchestratorRole", "batch:SubmitJob", queue.format("trnflow-ads-trn1-spot"))
    assert not TEAM_STACK.allows("OrchestratorRole", "batch:SubmitJob", queue.format("trnflow-trn1-spot"))


def test_a_teams_spot_instances_role_reaches_its_own_cluster_and_log_streams_alone():
    """What a team's single-node spot job could do with its instance's credentials: its own spot
    cluster's agent work and its own jobs' Batch streams; no other team's cluster, streams or
    folders, and nothing of any job's."""
    ecs = "arn:aws:ecs:us-east-1:123456789012"
    for cluster, allowed in (("trnflow-search-trn1-spot", True), ("trnflow-ads-trn1-spot", False),
                             ("trnflow-trn1-spot", False), ("trnflow-trn1", False)):
        assert TEAM_STACK.allows("SpotInstanceRole", "ecs:Poll",
                                 f"{ecs}:container-instance/{cluster}_Batch_0a1b/0f1e") is allowed, cluster
        assert TEAM_STACK.allows("SpotInstanceRole", "ecs:SubmitTaskStateChange",
                                 f"{ecs}:cluster/{cluster}_Batch_0a1b") is allowed, cluster
    stream = f"{LOGS}/aws/batch/job:log-stream:{{}}/default/0f1e2d3c"
    for definition, allowed in (("trnflow-search_m-0123456789ab", True), ("trnflow-ads_m-0123456789ab", False),
                                ("trnflow-search-ads_m-0123456789ab", False), ("trnflow-m-0123456789ab", False)):
        assert TEAM_STACK.allows("SpotInstanceRole", "logs:PutLogEvents", stream.format(definition)) is allowed
    for action, arn in [("s3:GetObject", f"{CHECKPOINTS}/teams/search/runs/m/x"), ("s3:ListBucket", STAGING),
                        ("iam:PassRole", JOB_ROLE),
                        ("secretsmanager:GetSecretValue", TEAM_STACK.ref("CacheSigningKey")),
                        ("logs:PutLogEvents", f"{LOGS}/aws/sagemaker/TrainingJobs:log-stream:x")]:
        assert not TEAM_STACK.allows("SpotInstanceRole", action, arn), action
    assert TEAM_STACK.ref("CacheSigningKey").startswith(
        "arn:aws:secretsmanager:us-east-1:123456789012:secret:trnflow/teams/search/cache-signing-key-")
    assert STACK.allows("compile", "secretsmanager:GetSecretValue", TEAM_STACK.ref("CacheSigningKey"),
                        job("compile", team="search"))  # the one its team's compile jobs read
    assert not STACK.allows("compile", "secretsmanager:GetSecretValue", TEAM_STACK.ref("CacheSigningKey"),
                            job("compile", team="ads"))


def test_multi_node_containers_cannot_reach_the_instances_role_and_logs_are_kept_for_a_while():
    """Multi-node jobs' containers have interfaces of their own (awsvpc), from which the hop limit would
    not keep them from the metadata service: the ECS agent blocks it there."""
    resources = _template()["Resources"]
    data = resources["NodeLaunchTemplate"]["Properties"]["LaunchTemplateData"]
    assert data["MetadataOptions"] == {"HttpTokens": "required", "HttpPutResponseHopLimit": 1}
    assert "echo ECS_AWSVPC_BLOCK_IMDS=true >> /etc/ecs/ecs.config" in data["UserData"]["Fn::Base64"]
    groups = {r["Properties"]["LogGroupName"]: r["Properties"] for r in resources.values()
              if r["Type"] == "AWS::Logs::LogGroup"}
    assert set(groups) == {"/aws/sagemaker/TrainingJobs", "/aws/batch/job"}
    assert all(g["RetentionInDays"] == {"Ref": "LogRetentionDays"} for g in groups.values())


@pytest.mark.parametrize(("role", "cluster", "other"), [("BatchInstanceRole", "trnflow-trn1", "trnflow-trn1-spot"),
                                                     ("SpotInstanceRole", "trnflow-trn1-spot", "trnflow-trn1")])
def test_each_instance_role_is_the_ecs_agents_alone_on_its_own_environments_cluster(role, cluster, other):
    """What a spot job, which shares its host's network, could do with its instance's credentials: no
    more than its node's ECS agent does, on the cluster Batch made for the spot environment; never on
    the multi-node jobs' nodes, another team's clusters, the buckets or IAM."""
    assert not any("iam::aws:policy" in str(arn) for arn in STACK.resources[role]["Properties"]["ManagedPolicyArns"])
    ecs = "arn:aws:ecs:us-east-1:123456789012"
    for name, allowed in ((cluster, True), (other, False), ("payments", False)):
        assert STACK.allows(role, "ecs:RegisterContainerInstance", f"{ecs}:cluster/{name}_Batch_0a1b2c3d") is allowed
        assert STACK.allows(role, "ecs:Poll", f"{ecs}:container-instance/{name}_Batch_0a1b2c3d/0f1e") is allowed
        assert STACK.allows(role, "ecs:SubmitTaskStateChange", f"{ecs}:cluster/{name}_Batch_0a1b2c3d") is allowed
        assert STACK.allows(role, "ecs:UpdateContainerInstancesState",
                            f"{ecs}:container-instance/{name}_Batch_0a1b2c3d/0f1e") is allowed
    assert not STACK.allows(role, "ecs:CreateCluster", f"{ecs}:cluster/{cluster}_Batch_0a1b2c3d")
    logs = "arn:aws:logs:us-east-1:123456789012:log-group:"
    assert STACK.allows(role, "logs:PutLogEvents", f"{logs}/aws/batch/job:log-stream:x")
    assert not STACK.allows(role, "logs:PutLogEvents", f"{logs}/aws/sagemaker/TrainingJobs:log-stream:x")
    assert not STACK.allows(role, "logs:PutLogEvents", f"{logs}/payments:log-stream:x")
    assert STACK.allows(role, "ecr:BatchGetImage", STACK.attribute("ImageRepository", "Arn"))
    assert not STACK.allows(role, "ecr:BatchGetImage", "arn:aws:ecr:us-east-1:123456789012:repository/payments")
    # nothing of the jobs': every write and read a job role may do, refused on the resources themselves
    for action, arn in [("s3:PutObject", WRITES["checkpoint"]), ("s3:GetObject", WRITES["checkpoint"]),
                        ("s3:PutObject", WRITES["result"]), ("s3:PutObject", WRITES["cache entry"]),
                        ("s3:ListBucket", STAGING), ("iam:PassRole", "arn:aws:iam::123456789012:role/trnflow/x"),
                        ("secretsmanager:GetSecretValue", STACK.ref("CacheSigningKey")),
                        ("ec2:TerminateInstances", "arn:aws:ec2:us-east-1:123456789012:instance/i-0123")]:
        assert not STACK.allows(role, action, arn), (role, action)


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
    skips = [(name, skip) for path in (TEMPLATE, TEAM_TEMPLATE) for name, r in _template(path)["Resources"].items()
             for skip in r.get("Metadata", {}).get("checkov", {}).get("skip", [])]
    assert skips
    for name, skip in skips:
        assert re.fullmatch(r"CKV_AWS_\d+", skip["id"]) and len(skip.get("comment", "")) > 30, (name, skip)


def _wait_for_checkov() -> None:
    """`make test` makes checkov's venv beside the tests (and says so): wait until it is whole."""
    made = CHECKOV.parents[1] / ".installed"
    gave_up = time.monotonic() + 300
    while BESIDE and not made.exists():
        assert time.monotonic() < gave_up, ("checkov's venv, made beside the tests by `make test` (make "
                                            "checkov-beside), is not whole after 5 minutes: make test's output "
                                            "has its install's")
        time.sleep(2)


@pytest.mark.skipif(not (CHECKOV.exists() or BESIDE), reason="checkov's own venv is made by `make test` (make checkov)")
def test_checkov_passes_the_template():
    _wait_for_checkov()
    result = subprocess.run([str(CHECKOV), "--framework", "cloudformation", "-f", str(TEMPLATE), "-f",
                             str(TEAM_TEMPLATE), "--compact", "--quiet", "--skip-download", "--output", "json"],
                            capture_output=True, text=True, timeout=300)
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]]
    scanned = sum(r["summary"]["passed"] for r in reports)
    assert result.returncode == 0 and not failed and scanned > 100, (failed, scanned)


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
    for role in (*JOB_POLICIES, "BatchInstanceRole", "SpotInstanceRole"):
        assert not STACK.allows(role, "ec2:TerminateInstances", instance, ours | _as(role)), role
    assert STACK.allows("OrchestratorRole", "ec2:DescribeInstances", "*")  # each node's launch, for the bill
    assert STACK.allows("OrchestratorRole", "ec2:DescribeSpotPriceHistory", "*")  # and a spot job's price


def test_the_orchestrator_stops_only_trnflows_jobs_and_reads_where_their_nodes_ran():
    """TerminateJob reaches only jobs tagged with a trnflow run (every job it submits is); and to
    replace a bad node it reads the job's own placement from ECS, never a node's word."""
    job_arn = "arn:aws:batch:us-east-1:123456789012:job/5d9e1b2c-0000-4000-8000-000000000000"
    ours = {"aws:PrincipalTag/trnflow-team": "default", "aws:ResourceTag/trnflow-team": "default"}
    assert STACK.allows("OrchestratorRole", "batch:TerminateJob", job_arn,
                        ours | {"aws:ResourceTag/trnflow:run-id": "r1"})
    assert not STACK.allows("OrchestratorRole", "batch:TerminateJob", job_arn, ours)  # a job trnflow did not submit
    assert not STACK.allows("OrchestratorRole", "batch:TerminateJob", job_arn,
                            ours | {"aws:ResourceTag/trnflow:run-id": ""})
    instance = "arn:aws:ecs:us-east-1:123456789012:container-instance/OnDemand_Batch_x/0f1e2d3c"
    assert STACK.allows("OrchestratorRole", "ecs:DescribeContainerInstances", instance)
    assert STACK.allows("OrchestratorRole", "batch:DescribeComputeEnvironments", "*")
    for kind in JOB_POLICIES:
        tagged = {"aws:ResourceTag/trnflow:run-id": "r1"} | job(kind)
        assert not STACK.allows(kind, "batch:TerminateJob", job_arn, tagged), kind
