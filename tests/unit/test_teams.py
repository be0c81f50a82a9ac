"""Teams: a run's team comes from who starts it, and what its spec names must lie inside the team's
prefixes. Each attack a spec could make on another team, tried, and refused before any job."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import yaml
from typer.testing import CliRunner

from tests.conftest import ON_S3, quickstart_data
from trnflow.backends import claim_run, run_team, team_problem
from trnflow.backends.teams import caller_team, own_team, team_of
from trnflow.cli.app import app
from trnflow.errors import FatalError
from trnflow.lifecycle.locations import team_problems
from trnflow.reporting.tracking import TrackedRun, credentials, send
from trnflow.settings import TrnflowSettings
from trnflow.specs import validate_spec
from trnflow.teams import DEFAULT_TEAM, PriorityClass, Teams, inside, parse_teams

pytestmark = pytest.mark.unit


def _teams(tmp_path, local_team: str | None = "search") -> dict:
    """Two teams, each under its own folder of tmp_path (and its own S3 prefixes)."""
    declared = {"teams": [
        {"name": name, "checkpoints": str(tmp_path / name / "checkpoints"),
         "registry": str(tmp_path / name / "registry"), "outputs": str(tmp_path / name / "outputs"),
         "cache": str(tmp_path / name / "cache"),
         "read": [str(tmp_path / "data")], "mlflow_uri": f"https://mlflow-{name}.example",
         "mlflow_credentials": f"{name.upper()}_MLFLOW", "share_identifier": name}
        for name in ("search", "ads")]}
    if local_team:
        declared["local_team"] = local_team
    return declared


def _file(tmp_path, declared: dict, monkeypatch) -> str:
    path = tmp_path / "teams.yaml"
    path.write_text(yaml.safe_dump(declared))
    monkeypatch.setenv("TRNFLOW_TEAMS", str(path))
    return str(path)


def _spec(tmp_path, team: str = "search", **sections):
    base = {"data": {"train": str(tmp_path / "data" / "train"), "holdout": str(tmp_path / "data" / "holdout"),
                     "inference": str(tmp_path / "data" / "inference")},
            "train": {"checkpoint_url": str(tmp_path / team / "checkpoints" / "reviews")},
            "compile": {"cache_url": str(tmp_path / team / "cache")},
            "inference": {"output_url": str(tmp_path / team / "outputs" / "reviews")},
            "gate": {"reference": None}, "registry_url": str(tmp_path / team / "registry")}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if isinstance(values, dict) else values
    return validate_spec(quickstart_data(**base))


def test_a_location_lies_inside_a_prefix_segment_by_segment_and_never_by_climbing_out():
    assert inside("s3://b/teams/a/runs/x", "s3://b/teams/a") and inside("s3://b/teams/a", "s3://b/teams/a/")
    assert not inside("s3://b/teams/ab/x", "s3://b/teams/a")  # a longer name is another team
    assert not inside("s3://b/teams/a/../b/x", "s3://b/teams/a") and not inside("s3://c/teams/a", "s3://b/teams/a")
    assert inside("file:///srv/a%20b/x", "/srv/a b") and not inside("/srv/a/x", "s3://srv/a")


@pytest.mark.parametrize(("change", "said"), [
    ({"teams": []}, "teams: List should have at least 1 item"),
    ({"local_team": "nobody"}, "local_team 'nobody' is not a declared team"),
    ({"teams": [{"name": "a", "checkpoints": "s3://b/a", "registry": "s3://b/a", "outputs": "s3://b/a",
                 "cache": None}]}, "team a: no prefix for compile.cache_url"),
    ({"teams": [{"name": "A b", "checkpoints": "s3://b/a", "registry": "s3://b/a", "outputs": "s3://b/a",
                 "cache": "s3://b/a"}]}, "teams.0.name: String should match pattern"),
    ({"teams": [{"name": "a", "checkpoints": "s3://b/a/../c", "registry": "s3://b/a", "outputs": "s3://b/a",
                 "cache": "s3://b/a"}]}, "has an empty, `.` or `..` segment"),
    ({"owner": "me"}, "owner: Extra inputs are not permitted"),
    ({"teams": [{"name": "default", "checkpoints": "s3://b/c", "registry": "s3://b/r", "outputs": "s3://b/o",
                 "cache": "s3://b/k"}]}, "'default' is the one team of a stack that declares none"),
    ({"teams": [{"name": "a", "checkpoints": "s3://b/a", "registry": "s3://b/a/registry", "outputs": "s3://b/o",
                 "cache": "s3://b/k"}]}, "team a: its train.checkpoint_url prefix s3://b/a and its registry_url "
                                         "prefix s3://b/a/registry overlap"),
    ({"teams": [{"name": "a", "checkpoints": "s3://b/c", "registry": "s3://b/r", "outputs": "s3://b/o",
                 "cache": "s3://b/k", "classes": ["production", "urgent"]}]},
     "teams.0.classes (team a): ['urgent'] are not among the file's classes (production, experiment)"),
    ({"classes": [{"name": "production", "priority": 100}],
      "teams": [{"name": "a", "checkpoints": "s3://b/c", "registry": "s3://b/r", "outputs": "s3://b/o",
                 "cache": "s3://b/k", "classes": "production"}]}, "teams.0.classes: Input should be a valid tuple"),
    ({"classes": [{"name": "production", "priority": 10}, {"name": "experiment", "priority": 10}]},
     "classes: two classes have one priority"),
])
def test_a_teams_file_that_is_not_one_is_refused_naming_the_file_and_field(tmp_path, change, said):
    declared = {**_teams(tmp_path), **change}
    with pytest.raises(FatalError, match=r"teams file ops/teams\.yaml: ") as raised:
        parse_teams(yaml.safe_dump(declared), "ops/teams.yaml")
    assert said in str(raised.value)


def test_without_a_teams_file_there_is_one_team_that_reaches_anywhere(tmp_path, monkeypatch):
    monkeypatch.delenv("TRNFLOW_TEAMS", raising=False)
    team = team_of("local", TrnflowSettings())
    assert team.name == DEFAULT_TEAM and team.unrestricted
    assert team_problems(_spec(tmp_path, "elsewhere"), team) == []


def test_a_spec_naming_another_teams_folders_is_refused_field_by_field(tmp_path, monkeypatch):
    _file(tmp_path, _teams(tmp_path), monkeypatch)
    team = run_team(_spec(tmp_path))
    assert team.name == "search" and team_problems(_spec(tmp_path), team) == []
    ads = tmp_path / "ads"
    spec = _spec(tmp_path, registry_url=str(ads / "registry"), train={"checkpoint_url": str(ads / "checkpoints")},
                 data={"holdout": str(ads / "private")}, compute={"share_identifier": "ads"},
                 tracking={"mlflow_uri": "https://mlflow-ads.example"})
    found = "\n".join(team_problems(spec, team))
    assert f"registry_url: file://{ads}/registry is outside team search's prefix file://{tmp_path}/search/registry" \
        in found
    assert f"train.checkpoint_url: file://{ads}/checkpoints is outside team search's prefix" in found
    assert f"data.holdout: file://{ads}/private is outside what team search may read" in found
    assert "tracking.mlflow_uri: https://mlflow-ads.example is not team search's tracking server" in found
    assert "compute.share_identifier: ads is not team search's share (search)" in found
    assert inside(str(tmp_path / "search" / "outputs" / "x"), team.outputs)  # its own stay its own
    loopback = _spec(tmp_path, tracking={"mlflow_uri": "http://127.0.0.1:5000"})
    assert team_problems(loopback, team) == []  # a server on this machine, for a run on its cores
    weights = validate_spec(quickstart_data(**{**_spec(tmp_path).model_dump(mode="json"), "model": {
        "recipe": "hf-causal-lm", "params": {"pretrained": "s3://models/ads/base", "seq_len": 32}},
        "gate": {"reference": None, "metric": "perplexity", "metrics": []}}))
    assert team_problems(weights, team) == [
        f"model.params.pretrained: s3://models/ads/base is outside what team search may read ("
        f"{', '.join(p for p in (*team.writes().values(), *team.read) if p)}); read from there, or ask the "
        "operators to add it to the team's `read`"]


def test_trnflow_run_refuses_a_spec_outside_its_team_before_any_job(tmp_path, monkeypatch, trnflow_home):
    _file(tmp_path, _teams(tmp_path), monkeypatch)
    spec = _spec(tmp_path, registry_url=str(tmp_path / "ads" / "registry"))
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["run", str(path)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert "registry_url:" in said and f"outside team search's prefix file://{tmp_path}/search/registry" in said
    assert "Traceback" not in result.output and not (tmp_path / "ads").exists()


@pytest.mark.parametrize("command", [["compile"], ["reference"],
                                     pytest.param(["plan", "--calibrate"], marks=pytest.mark.slow)])  # builds a model
def test_a_command_that_starts_a_job_by_itself_refuses_a_spec_outside_its_team(tmp_path, monkeypatch, command):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))  # its own: any job it started would be here
    _file(tmp_path, _teams(tmp_path), monkeypatch)
    spec = _spec(tmp_path, compile={"cache_url": str(tmp_path / "ads" / "cache")})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, [*command, str(path)])
    assert result.exit_code == 2, result.output
    assert f"compile.cache_url: file://{tmp_path}/ads/cache is outside team search's prefix" in " ".join(
        result.stderr.split())
    assert not (tmp_path / "ads").exists() and not (tmp_path / "home" / "jobs").exists()


def test_trnflow_reference_writes_its_file_only_where_the_team_writes_never_in_a_folder_it_only_reads(
        tmp_path, monkeypatch):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    _file(tmp_path, _teams(tmp_path), monkeypatch)
    shared = tmp_path / "data" / "reference.json"  # the team's `read`: data every run of it trusts
    spec = _spec(tmp_path, gate={"reference": str(shared)})
    assert team_problem(spec) is None  # a run may read it there
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["reference", str(path)])
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert f"gate.reference: file://{shared} is outside what team search may write (file://{tmp_path}/search/" in said
    assert not shared.exists() and not (tmp_path / "home" / "jobs").exists()
    own = _spec(tmp_path, gate={"reference": str(tmp_path / "search" / "outputs" / "reference.json")})
    assert team_problem(own, writes_reference=True) is None


def test_a_runs_priority_class_is_one_its_team_may_use_and_orders_its_batch_jobs(tmp_path):
    """Priority classes are the operators' (the teams file's `classes`, each team's allowed ones by
    name); a spec names its run's class, refused when its team may not use it; a declared team's
    Batch jobs take the class's priority, never a number a spec chose."""
    from trnflow.backends.batch_request import scheduling_priority
    from trnflow.teams import UNDECLARED

    declared = _teams(tmp_path)
    declared["classes"] = [{"name": "tier-1", "priority": 500}, {"name": "production", "priority": 100},
                           {"name": "experiment", "priority": 10}]
    declared["teams"][1]["classes"] = ["experiment"]  # ads may run experiments alone
    teams = parse_teams(yaml.safe_dump(declared), "teams.yaml")
    search, ads = teams.named("search"), teams.named("ads")
    assert [c.name for c in search.classes] == ["tier-1", "production", "experiment"]  # unset: every class
    assert Teams.model_validate(teams.model_dump()) == teams  # written out whole, read back the same
    with pytest.raises(ValueError, match=r"team search: classes \['tier-1', 'production', 'experiment'\] are not "
                                         r"the file's classes \(production\)"):
        Teams(classes=[PriorityClass(name="production", priority=1)], teams=[search])  # 100 there, 1 here
    assert search.priority_class(None).name == "experiment" and ads.priority_class("tier-1") is None
    tier_1 = _spec(tmp_path, compute={"priority_class": "tier-1"})
    assert team_problems(tier_1, search) == []
    assert team_problems(tier_1, ads)[0] == ("compute.priority_class: team ads may not run tier-1 runs (its classes: "
                                             "experiment); name one of those, or ask the operators")
    on_batch = validate_spec(quickstart_data(**ON_S3, train={"checkpoint_url": "s3://acme-data/runs"}, compute={
        "backend": "batch", "instance_type": "trn1.32xlarge", "scheduling_priority": 9999}))
    assert ("compute.scheduling_priority: team search's runs are ordered by their priority class "
            "(compute.priority_class), never by a spec's number; remove it") in team_problems(on_batch, search)
    assert not any("scheduling_priority" in p for p in team_problems(_spec(tmp_path, compute={  # no effect off Batch
        "scheduling_priority": 9999}), search))
    with pytest.raises(FatalError, match="team ads may not run tier-1 runs"):
        scheduling_priority(tier_1, ads)  # never a fallback to the spec's number
    assert scheduling_priority(tier_1, search) == 500
    assert scheduling_priority(_spec(tmp_path), search) == 10  # no class named: its lowest
    # a stack that declares no teams: the spec's own number, unless it names a class; an unknown class refused
    assert scheduling_priority(_spec(tmp_path, compute={"scheduling_priority": 7}), UNDECLARED) == 7
    assert scheduling_priority(_spec(tmp_path, compute={"priority_class": "production"}), UNDECLARED) == 100
    assert team_problems(_spec(tmp_path, compute={"priority_class": "tier-1"}), UNDECLARED)[0].startswith(
        "compute.priority_class: team default may not run tier-1 runs (its classes: production, experiment)")


def test_the_teams_file_docs_cloud_md_shows_is_one():
    from pathlib import Path

    from tests.markdown import FENCE

    page = (Path(__file__).resolve().parents[2] / "docs" / "cloud.md").read_text()
    (example,) = [body for language, body in FENCE.findall(page) if language == "yaml" and "\nteams:\n" in body]
    teams = parse_teams(example, "docs/cloud.md")
    (team,) = teams.teams
    assert teams.local_team == team.name and [c.name for c in team.classes] == ["production", "experiment"]


def test_a_local_run_on_a_machine_whose_teams_name_no_local_team_is_refused(tmp_path, monkeypatch):
    _file(tmp_path, _teams(tmp_path, local_team=None), monkeypatch)
    assert "names no local_team" in team_problem(_spec(tmp_path))
    with pytest.raises(FatalError, match="names no local_team"):
        claim_run(_spec(tmp_path), "r1")


def test_a_run_id_is_bound_to_its_team_and_model_at_first_use(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    _file(tmp_path, _teams(tmp_path), monkeypatch)
    spec = _spec(tmp_path)
    assert claim_run(spec, "r1").name == "search"
    assert claim_run(spec, "r1").name == "search"  # a rerun, to resume it
    other_model = spec.model_copy(update={"name": "other"})
    with pytest.raises(FatalError, match="run id r1 is run quickstart of team search's"):
        claim_run(other_model, "r1")
    _file(tmp_path, _teams(tmp_path, local_team="ads"), monkeypatch)  # the same id, started by another team
    with pytest.raises(FatalError, match="run id r1 is run quickstart of team search's"):
        claim_run(_spec(tmp_path, "ads", data={"train": str(tmp_path / "data" / "train")}), "r1")
    assert json.loads((tmp_path / "home" / "owners" / "r1.owner.json").read_text()) == {
        "team": "search", "model": "quickstart"}


def test_a_declared_teams_local_jobs_check_the_cache_with_its_own_key_never_the_machines(tmp_path, monkeypatch):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from trnflow.backends import backend_for, cache_keys
    from trnflow.device.signing import public_text

    machine, own = (public_text(Ed25519PrivateKey.generate().public_key()) for _ in range(2))
    monkeypatch.setenv("TRNFLOW_CACHE_PUBLIC_KEY", machine)
    assert public_text(cache_keys(_spec(tmp_path)).trusted) == machine  # no teams: the machine's key
    declared = _teams(tmp_path)
    declared["teams"][0]["cache_public_key"] = own
    _file(tmp_path, declared, monkeypatch)
    assert public_text(cache_keys(_spec(tmp_path)).trusted) == own
    assert backend_for(_spec(tmp_path)).team.cache_public_key == own  # what its jobs are given
    del declared["teams"][0]["cache_public_key"]
    _file(tmp_path, declared, monkeypatch)
    assert cache_keys(_spec(tmp_path)).trusted is None  # the machine's key checks no team's cache


# --- in the cloud, the team is the starter's tag -----------------------------------------------------

def _principal(iam, name: str, team: str | None) -> dict:
    tags = [{"Key": "trnflow-team", "Value": team}] if team else []
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                     "Principal": {"AWS": "arn:aws:iam::123456789012:root"}}]}
    return iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust), Tags=tags)["Role"]


def _as(monkeypatch, sts, role: dict) -> None:
    found = sts.assume_role(RoleArn=role["Arn"], RoleSessionName="submit")["Credentials"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", found["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", found["SecretAccessKey"])
    monkeypatch.setenv("AWS_SESSION_TOKEN", found["SessionToken"])


def test_a_cloud_runs_team_is_its_starters_tag_and_an_untagged_starter_is_refused(in_process_aws, tmp_path,
                                                                                   monkeypatch):
    import boto3

    iam, sts = boto3.client("iam"), boto3.client("sts")
    teams = Teams.model_validate(_teams(tmp_path))
    search, untagged, stranger = (_principal(iam, "search-submit", "search"), _principal(iam, "anyone", None),
                                  _principal(iam, "stranger", "payments"))
    _as(monkeypatch, sts, search)
    assert caller_team(teams).name == "search"
    _as(monkeypatch, sts, untagged)
    with pytest.raises(FatalError, match="assumed-role/anyone/submit has no trnflow-team tag"):
        caller_team(teams)
    _as(monkeypatch, sts, stranger)
    with pytest.raises(FatalError, match="tagged trnflow-team=payments, which is not a declared team"):
        caller_team(teams)


# --- tracking credentials go to the team's own server alone ------------------------------------------

class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[str | None]] = []

    def do_GET(self):  # every request is answered 500, after its credentials are noted
        type(self).seen.append(self.headers.get("Authorization"))
        self.send_response(500)
        self.end_headers()

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def recorder():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    _Recorder.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Recorder.seen
    server.shutdown()


def test_the_orchestrators_tracking_token_never_reaches_a_server_that_is_not_its_teams(recorder, monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    url, seen = recorder
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "orchestrator-secret")
    monkeypatch.setenv("SEARCH_MLFLOW_TOKEN", "search-secret")
    teams = Teams.model_validate(_teams(tmp_path))
    search = teams.named("search")
    run = TrackedRun(uri=url, experiment="e", run_id="r1", finished=True)
    with pytest.raises(Exception):  # noqa: B017  # the server answers 500: what matters is what it was sent
        send(run, search)
    assert seen and all(header is None for header in seen)  # not the team's server: no credentials at all
    seen.clear()
    ours = search.model_copy(update={"mlflow_uri": url})
    with pytest.raises(Exception):  # noqa: B017
        send(run, ours)
    assert seen and all(header == "Bearer search-secret" for header in seen)
    assert credentials("https://mlflow-search.example:443/x", search)["MLFLOW_TRACKING_TOKEN"] == "search-secret"
    assert credentials("https://mlflow-search.example:8443", search)["MLFLOW_TRACKING_TOKEN"] is None
    import os

    assert os.environ["MLFLOW_TRACKING_TOKEN"] == "orchestrator-secret"  # put back as it was


def test_credentials_held_back_from_a_server_are_named_in_the_runs_summary(monkeypatch, tmp_path):
    from trnflow.reporting.tracking import withheld
    from trnflow.teams import UNDECLARED

    monkeypatch.delenv("SEARCH_MLFLOW_TOKEN", raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "secret")
    said = withheld("https://mlflow.example", UNDECLARED)
    assert "MLFLOW_TRACKING_TOKEN not sent: https://mlflow.example is not team default's tracking server" in said
    assert "TRNFLOW_MLFLOW_URI" in said and "secret" not in said
    ours = UNDECLARED.model_copy(update={"mlflow_uri": "https://mlflow.example"})
    assert withheld("https://mlflow.example/", ours) == ""  # sent: nothing to say
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN")
    assert withheld("https://elsewhere.example", UNDECLARED) == ""  # nothing held: nothing to say


@pytest.mark.slow  # moto's IAM, STS, SSM and S3: about 6 s
def test_a_declared_teams_cloud_run_gets_its_own_staging_and_keys_and_never_fixed_roles(in_process_aws, tmp_path,
                                                                                          monkeypatch):
    import boto3

    from trnflow.backends.cloud import cloud_target, published_settings

    iam, sts, ssm = boto3.client("iam"), boto3.client("sts"), boto3.client("ssm")
    declared = _teams(tmp_path)
    declared["teams"][0] |= {"cache_public_key": "ed25519:" + "A" * 43 + "=",
                             "cache_signing_key": "arn:aws:secretsmanager:us-east-1:123456789012:secret:search-k",
                             "batch_spot_job_queue": "trnflow-search-trn1-spot"}
    for n in range(12):  # more than one page of settings: the teams file is on the second
        ssm.put_parameter(Name=f"/trnflow/other-{n:02d}", Value="x", Type="String")
    boto3.client("s3").create_bucket(Bucket="ops")
    boto3.client("s3").put_object(Bucket="ops", Key="teams.yaml", Body=yaml.safe_dump(declared).encode())
    ssm.put_parameter(Name="/trnflow/teams", Value="s3://ops/teams.yaml", Type="String")
    assert published_settings("/trnflow")["teams"] == "s3://ops/teams.yaml"
    for key, value in {"TRNFLOW_STAGING_URL": "s3://staging/jobs", "TRNFLOW_IMAGE": "img:1",
                       "TRNFLOW_SAGEMAKER_ROLE_ARN": "arn:aws:iam::123456789012:role/fixed",
                       "TRNFLOW_CACHE_PUBLIC_KEY": "ed25519:" + "B" * 43 + "=",
                       "TRNFLOW_BATCH_JOB_QUEUE": "trnflow-trn1", "TRNFLOW_BATCH_SPOT_JOB_QUEUE": "trnflow-trn1-spot"
                       }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TRNFLOW_TEAMS", raising=False)
    _as(monkeypatch, sts, _principal(iam, "search-submit", "search"))
    with pytest.raises(FatalError, match="team search is declared, and its jobs would run as the deployment's "
                                         "fixed roles"):
        cloud_target(TrnflowSettings(), "sagemaker")
    monkeypatch.setenv("TRNFLOW_JOB_POLICIES", "arn:aws:iam::123456789012:policy/trnflow/")
    target = cloud_target(TrnflowSettings(), "sagemaker")
    assert (target.team.name, target.staging_url) == ("search", "s3://staging/jobs/search")
    assert target.cache_public_key == "ed25519:" + "A" * 43 + "="  # the team's, never the stack's
    assert target.cache_signing_key.endswith(":secret:search-k")
    batch = cloud_target(TrnflowSettings(), "batch")  # spot capacity of its own: its instances' role is its own
    assert (batch.job_queue, batch.spot_job_queue) == ("trnflow-trn1", "trnflow-search-trn1-spot")
    ads = Teams.model_validate(declared).named("ads")  # a run's team, once claimed, is not decided again
    assert cloud_target(TrnflowSettings(), "sagemaker", ads).staging_url == "s3://staging/jobs/ads"


def test_a_team_without_spot_capacity_of_its_own_gets_no_batch_spot_job(tmp_path, monkeypatch):
    """A single-node spot job shares its host's network, and so can read its instance's role: the
    stack's spot queue is the default team's alone, and a declared team's spot jobs need its own."""
    _file(tmp_path, _teams(tmp_path), monkeypatch)
    team = run_team(_spec(tmp_path))
    spot = validate_spec(quickstart_data(**ON_S3, train={"checkpoint_url": "s3://acme-data/runs"}, compute={
        "backend": "batch", "instance_type": "trn1.32xlarge", "nodes": 1, "cores_per_node": 32, "spot": True}))
    assert team_problems(spot, team)[-1].startswith("compute.spot: team search has no Batch spot queue of its own")
    own = team.model_copy(update={"batch_spot_job_queue": "trnflow-search-trn1-spot"})
    assert not any(p.startswith("compute.spot") for p in team_problems(spot, own))


def test_a_runs_team_is_decided_once_and_every_stage_that_starts_jobs_is_given_it(tmp_path, monkeypatch):
    """The flows hand each job-starting task the run's team (`StageRunner.team`, from `claim_run`),
    so no stage decides it again (for a cloud run: the settings, STS and IAM, every stage)."""
    import ast
    import inspect
    from pathlib import Path

    from trnflow import backends, flows
    from trnflow.backends import backend_for, cache_keys
    from trnflow.tasks import collectives, compile, evaluate, infer, reference, sanity, train

    _file(tmp_path, _teams(tmp_path), monkeypatch)
    team = run_team(_spec(tmp_path))

    def decided(*args, **kwargs):
        raise AssertionError("the team was decided again")
    monkeypatch.setattr(backends, "team_of", decided)
    assert backend_for(_spec(tmp_path), TrnflowSettings(), team).team == team
    assert cache_keys(_spec(tmp_path), team=team).trusted is None  # the team declares no key: none, not the machine's
    starting = {name for module in (sanity, collectives, compile, train, reference, evaluate, infer)
                for name, fn in vars(module).items()
                if hasattr(fn, "fn") and "team" in inspect.signature(fn.fn).parameters}
    assert starting == {"sanity_check", "collective_test", "compile_graphs", "train_model", "fp32_reference",
                        "evaluate_gate", "batch_infer"}
    calls = 0
    for path in Path(flows.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "stage"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Name) and node.args[1].id in starting):
                calls += 1
                given = {k.arg: ast.unparse(k.value) for k in node.keywords}
                assert given.get("team") == "stage.team", f"{path.name}:{node.lineno} gives no team=stage.team"
    assert calls >= 10


def test_plain_http_to_another_machine_is_refused_in_a_spec(tmp_path):
    from trnflow.specs import SpecError

    with pytest.raises(SpecError, match="plain http on another machine"):
        _spec(tmp_path, tracking={"mlflow_uri": "http://mlflow.example:5000"})
    assert _spec(tmp_path, tracking={"mlflow_uri": "http://localhost:5000"}).tracking.mlflow_uri


def test_a_kept_mirror_with_a_file_name_that_is_a_path_or_a_bad_server_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TRNFLOW_HOME", str(tmp_path / "home"))
    kept = tmp_path / "home" / "tracking"
    kept.mkdir(parents=True)
    good = TrackedRun(uri="https://mlflow.example", experiment="e", run_id="r1", finished=True)
    for run_id, change in (("r1", {"images": {"../../.bashrc": "AAAA"}}), ("r2", {"uri": "http://evil.example"}),
                           ("r3", {"artifacts": {"a/b.md": "x"}})):
        (kept / f"{run_id}.json").write_text(json.dumps({**good.model_dump(), "run_id": run_id, **change}))
        result = CliRunner().invoke(app, ["tracking", "sync", run_id])
        assert result.exit_code == 2, result.output
        assert f"{kept}/{run_id}.json" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / ".bashrc").exists()


def test_a_command_outside_a_run_whose_team_cannot_be_decided_sends_no_credentials(tmp_path, monkeypatch):
    _file(tmp_path, _teams(tmp_path, local_team=None), monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # no AWS here: the caller cannot be told
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    team = own_team(TrnflowSettings())
    assert team.name == DEFAULT_TEAM and team.mlflow_uri is None


def test_a_teams_quotas_are_checked_when_declared_and_a_run_they_could_never_admit_is_refused(tmp_path):
    declared = _teams(tmp_path)
    declared["teams"][0] |= {"quotas": {"local": 4, "trn1.32xlarge": 2}, "weight": 3.0}
    declared["teams"][1] |= {"quotas": {"local": 1}, "borrow": True, "lend": False}
    teams = parse_teams(yaml.safe_dump(declared), "teams.yaml")
    search, ads = teams.named("search"), teams.named("ads")
    assert (search.quota("local"), search.quota("trn1.2xlarge"), search.weight, search.borrow, search.lend) == (
        4, 0, 3.0, False, True)  # a type it names no quota for: none
    two_cores = _spec(tmp_path)
    assert team_problems(two_cores, search) == []
    assert team_problems(_spec(tmp_path, "ads"), ads) == []  # over its quota, but it may borrow
    narrow = declared["teams"][0] | {"quotas": {"local": 1}}
    refused = team_problems(two_cores, parse_teams(yaml.safe_dump({"teams": [narrow]}), "t").teams[0])
    assert refused == ["compute: the run needs 2 NeuronCores of this machine and team search has a quota of 1 there "
                       "and may not borrow; ask for fewer, or ask the operators for a quota (the teams file's quotas)"]
    for bad, said in (({"trn1": 2}, "'trn1' is neither an instance type"), ({"local": -1}, "below zero")):
        declared["teams"][0]["quotas"] = bad
        with pytest.raises(FatalError, match=said):
            parse_teams(yaml.safe_dump(declared), "teams.yaml")


def test_the_stacks_capacity_of_a_type_is_declared_or_the_sum_of_every_teams_quota(tmp_path):
    from trnflow.backends.stack_queue import capacity_of

    declared = _teams(tmp_path)
    declared["teams"][0] |= {"quotas": {"trn1.32xlarge": 3}}
    declared["teams"][1] |= {"quotas": {"trn1.32xlarge": 2, "trn2.48xlarge": 1}}
    teams = parse_teams(yaml.safe_dump(declared), "teams.yaml")
    assert capacity_of(teams, "trn1.32xlarge") == 5 and capacity_of(teams, "trn2.48xlarge") == 1
    declared["teams"][1].pop("quotas")  # a team without quotas: nothing but a declared capacity limits the type
    teams = parse_teams(yaml.safe_dump(declared), "teams.yaml")
    assert capacity_of(teams, "trn1.32xlarge") is None
    declared["capacity"] = {"trn1.32xlarge": 8}
    assert capacity_of(parse_teams(yaml.safe_dump(declared), "teams.yaml"), "trn1.32xlarge") == 8
    for bad, said in (({"local": 2}, "not an instance type"), ({"trn1.32xlarge": -1}, "below zero")):
        declared["capacity"] = bad
        with pytest.raises(FatalError, match=said):
            parse_teams(yaml.safe_dump(declared), "teams.yaml")


def test_trnflow_teams_shares_gives_the_batch_policy_each_teams_share_at_its_weight(in_process_aws, tmp_path,
                                                                                      monkeypatch):
    import boto3
    from typer.testing import CliRunner

    from trnflow.cli.app import app
    from trnflow.testing.mockcloud.provision import SETTINGS, provision

    outputs = provision(boto3.client)
    for name in SETTINGS:
        monkeypatch.setenv(f"TRNFLOW_{name}", outputs[name])
    declared = _teams(tmp_path)
    declared["teams"][0] |= {"share_identifier": "search", "weight": 4.0, "quotas": {"trn1.32xlarge": 3}}
    declared["teams"][1] |= {"share_identifier": "ads", "weight": 0.5, "quotas": {"trn1.32xlarge": 1},
                             "borrow": True}
    _file(tmp_path, declared, monkeypatch)
    runner = CliRunner()
    listed = runner.invoke(app, ["teams", "list"])
    assert listed.exit_code == 0 and all(n in listed.output for n in ("search", "ads", "0.5")), listed.output
    as_json = json.loads(runner.invoke(app, ["teams", "list", "--json"]).output)
    assert [(t["name"], t["quotas"], t["borrow"]) for t in as_json["teams"]] == [
        ("search", {"trn1.32xlarge": 3}, False), ("ads", {"trn1.32xlarge": 1}, True)]
    shown = json.loads(runner.invoke(app, ["teams", "shares", "--json"]).output)
    assert not shown["applied"] and [s["identifier"] for s in shown["current"]] == ["default"]
    assert [(s["identifier"], s["weight_factor"], s["team"]) for s in shown["wanted"]] == [
        ("search", 0.25, "search"), ("ads", 2.0, "ads"), ("default", 1.0, None)]
    applied = runner.invoke(app, ["teams", "shares", "--apply"])
    assert applied.exit_code == 0 and "updated the policy" in applied.output, applied.output
    batch = boto3.client("batch")
    arn = batch.describe_job_queues(jobQueues=[outputs["BATCH_JOB_QUEUE"]])["jobQueues"][0]["schedulingPolicyArn"]
    (policy,) = batch.describe_scheduling_policies(arns=[arn])["schedulingPolicies"]
    assert {s["shareIdentifier"]: s["weightFactor"] for s in policy["fairsharePolicy"]["shareDistribution"]} == {
        "search": 0.25, "ads": 2.0, "default": 1.0}
    assert "already has these shares" in runner.invoke(app, ["teams", "shares"]).output
    monkeypatch.setenv("TRNFLOW_BATCH_JOB_QUEUE", "nope")
    missing = runner.invoke(app, ["teams", "shares"])
    assert missing.exit_code == 2 and "nope does not exist" in missing.stderr and "Traceback" not in missing.output
