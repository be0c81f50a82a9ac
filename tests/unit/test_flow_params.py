"""What every flow takes: the spec itself or where to read it, and the run form the UI shows for
it; and no secret in a relayed log line."""

import base64
import json
from urllib.parse import quote

import pytest
import yaml

from tests.conftest import EXAMPLES
from trnflow.flows._params import form_schema, resolve_spec
from trnflow.flows.deployments import definitions, spec_parameter
from trnflow.redact import MASK, Redactor, secret_values
from trnflow.specs import JobSpec, SpecError, load_spec, validate_spec

QUICKSTART = EXAMPLES / "quickstart.yaml"


def test_the_spec_parameter_wins_and_a_url_is_read_from_a_path_or_s3(in_process_aws, make_spec):
    import boto3

    given = make_spec()
    got = resolve_spec(given, str(QUICKSTART))  # a deployment's default spec_url does not override it
    assert got.model_copy(update={"train": given.train}) == given  # `auto` is decided, the rest is the given spec
    assert given.train.parallelism.strategy == "auto" and got.train.parallelism.strategy == "ddp"
    assert resolve_spec(None, str(QUICKSTART)).name == "quickstart"
    assert resolve_spec(None, QUICKSTART.as_uri()).name == "quickstart"

    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="specs")
    s3.put_object(Bucket="specs", Key="jobs/quickstart.yaml", Body=QUICKSTART.read_bytes())
    assert resolve_spec(None, "s3://specs/jobs/quickstart.yaml").name == "quickstart"
    with pytest.raises(SpecError, match="not found"):
        resolve_spec(None, "s3://specs/jobs/missing.yaml")
    bad = yaml.safe_load(QUICKSTART.read_text()) | {"colour": "blue"}
    s3.put_object(Bucket="specs", Key="jobs/bad.yaml", Body=yaml.safe_dump(bad).encode())
    with pytest.raises(SpecError) as caught:
        resolve_spec(None, "s3://specs/jobs/bad.yaml")
    assert caught.value.source == "s3://specs/jobs/bad.yaml" and caught.value.problems[0].startswith("colour:")


def test_a_missing_spec_or_an_unknown_scheme_is_a_clear_error():
    with pytest.raises(SpecError, match="give the job spec"):
        resolve_spec(None, None)
    with pytest.raises(SpecError, match="unsupported scheme 'gs'"):
        resolve_spec(None, "gs://bucket/spec.yaml")


def test_the_run_form_is_the_spec_inline_with_its_bounds_and_a_text_box_for_each_text_field():
    from prefect.utilities.callables import parameter_schema

    from trnflow.flows.pipeline import pipeline

    form = parameter_schema(pipeline).model_dump()
    job_spec = form["properties"]["spec"]  # the spec itself, not "a spec or null": the UI names a bad field
    own = ("default", "description", "position", "title")  # the parameter's, from the flow's docstring
    assert {k: v for k, v in job_spec.items() if k not in own} == {k: v for k, v in form_schema().items()
                                                                  if k not in own}
    assert not form["definitions"]  # every section inline: no $ref to follow
    text = json.dumps(job_spec)
    assert "$ref" not in text and '"pattern":' not in text.split()  # patterns are the run's, which explains them
    assert set(job_spec["properties"]) == set(JobSpec.model_fields)
    backend = job_spec["properties"]["compute"]["properties"]["backend"]
    assert set(backend["enum"]) == {"local", "sagemaker", "batch"}  # choices stay choices
    train = job_spec["properties"]["train"]["properties"]
    steps, lr = train["steps"], train["lr"]
    assert (steps["type"], steps["minimum"], steps["maximum"]) == ("integer", 1, 10**9)  # bounds the server enforces
    assert lr["exclusiveMinimum"] == 0 and lr["maximum"] == 10
    text_box = [{"type": "string"}, {"type": "null"}]  # one text box, not a tab per choice (`champion`, a URL)
    assert job_spec["properties"]["gate"]["properties"]["reference"]["anyOf"] == text_box
    assert job_spec["properties"]["train"]["properties"]["init_from"]["anyOf"] == text_box


def test_the_server_refuses_a_value_out_of_its_bounds_naming_the_field():
    """As the Prefect server checks a run's parameters against an enforcing deployment's schema."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, build_error_obj, validate

    from trnflow.flows.pipeline import pipeline

    schema = parameter_schema(pipeline).model_dump_for_openapi()
    filled = spec_parameter(load_spec(QUICKSTART))
    validate({"spec": filled}, schema, raise_on_error=True)
    for section, field, value, reason in [("train", "steps", -5, "-5 is less than the minimum of 1"),
                                          ("train", "lr", 80, "80 is greater than the maximum of 10"),
                                          ("train", "steps", "many", "'many' is not of type 'integer'")]:
        bad = {"spec": {**filled, section: {**filled[section], field: value}}}
        with pytest.raises(ValidationError) as caught:
            validate(bad, schema, raise_on_error=True)
        assert str(caught.value) == f"Validation failed for field 'spec.{section}.{field}'. Failure reason: {reason}"
        # the form's own check: the error sits under the field, not over the whole spec
        shown = build_error_obj(validate(bad, schema))["errors"][0]
        assert shown == {"property": "spec", "errors": [{"property": section, "errors": [
            {"property": field, "errors": [reason]}]}]}


def test_a_bad_value_from_the_form_fails_the_run_naming_the_field_and_the_fix():
    filled = spec_parameter(load_spec(QUICKSTART))
    with pytest.raises(SpecError) as caught:
        resolve_spec({**filled, "name": "Quick Start"}, None)
    assert caught.value.problems == ["name: 'Quick Start' is not allowed here; use lower-case letters, digits and "
                                     "dashes, starting with a letter or digit, at most 63 characters (for example "
                                     "'quick-start')"]
    with pytest.raises(SpecError, match=r"train\.steps: "):
        resolve_spec({**filled, "train": {**filled["train"], "steps": -5}}, None)


def test_a_deployment_carries_the_whole_spec_with_its_locations_as_written(tmp_path, monkeypatch):
    spec = load_spec(QUICKSTART)
    filled = spec_parameter(spec)
    assert validate_spec(filled) == spec  # every field filled in, and nothing changed
    written = yaml.safe_load(QUICKSTART.read_text())
    portable = spec_parameter(spec, written)
    assert portable["data"]["train"] == "runs/quickstart/data/train"  # relative to where the flows run
    assert portable["train"]["lr"] == filled["train"]["lr"] and set(portable) == set(filled)
    monkeypatch.chdir(tmp_path)
    assert validate_spec(portable).data.train == (tmp_path / "runs/quickstart/data/train").as_uri()
    names = [d["name"] for d in definitions(spec, str(QUICKSTART))]
    assert names == ["quickstart-pipeline", "quickstart-preflight", "quickstart-compile",
                     "quickstart-retrain", "quickstart-infer"]


def test_secret_looking_variables_are_masked_in_relayed_lines():
    environ = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG", "HF_TOKEN": "hf_abcdefgh", "DB_PASSWORD": "pw",
               "HOME": "/root", "WANDB_API_KEY": "0123456789abcdef"}
    values = set(secret_values(environ))
    assert {"wJalrXUtnFEMI/K7MDENG", "hf_abcdefgh", "0123456789abcdef"} <= values and "pw" not in values  # too short
    redact = Redactor(secret_values(environ))
    line = "uploading to s3 with wJalrXUtnFEMI/K7MDENG and hf_abcdefgh from /root"
    assert redact(line) == f"uploading to s3 with {MASK} and {MASK} from /root"
    assert Redactor([])("nothing to hide") == "nothing to hide"


def test_secrets_are_masked_in_the_forms_they_travel_in():
    """URL-encoded (a presigned URL's token), JSON-escaped, base64 (a Basic header); a database URL's
    password; the password half of PREFECT_API_AUTH_STRING; a URL's password in any line."""
    token = 'IQoJb3JpZ2luX2VjE/Ab+c="quoted"'
    environ = {"AWS_SESSION_TOKEN": token, "PREFECT_API_AUTH_STRING": "admin:s3cr3t-pass",
               "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://prefect:db-pa55word@db:5432/prefect",
               "DATABASE_URL": "postgres://u:another-pw@h/db", "HOME": "/root"}
    redact = Redactor(secret_values(environ))
    presigned = f"https://b.s3.amazonaws.com/k?X-Amz-Security-Token={quote(token, safe='')}&X-Amz-Expires=60"
    for line in (presigned, json.dumps({"token": token}), f"auth: {base64.b64encode(token.encode()).decode()}",
                 "login failed for password s3cr3t-pass", "could not connect with db-pa55word",
                 "Authorization: Basic " + base64.b64encode(b"admin:s3cr3t-pass").decode(),
                 "retrying postgres://u:another-pw@h/db", "redis://worker:never-listed-secret@cache:6379/0"):
        masked = redact(line)
        assert MASK in masked, line
        for secret in (token, quote(token, safe=""), json.dumps(token)[1:-1], "s3cr3t-pass", "db-pa55word",
                       "another-pw", "never-listed-secret"):
            assert secret not in masked, (line, masked)
    assert redact("https://bucket.s3.amazonaws.com/key and a@b.c") == "https://bucket.s3.amazonaws.com/key and a@b.c"


def test_stopping_serve_asks_a_busy_server_again_and_a_gone_one_never():
    import httpx

    from trnflow.flows.serving import _busy

    request = httpx.Request("PATCH", "http://127.0.0.1:4200/api/deployments/x")
    for status, again in ((503, True), (500, True), (429, True), (404, False), (409, False)):
        error = httpx.HTTPStatusError("x", request=request, response=httpx.Response(status, request=request))
        assert _busy(error) is again, status
    assert not _busy(httpx.ConnectError("refused", request=request)) and not _busy(TimeoutError())
