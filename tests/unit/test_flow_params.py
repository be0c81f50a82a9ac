"""What every flow takes: the spec itself or where to read it; and no secret in a relayed log line."""

import pytest
import yaml

from tests.conftest import EXAMPLES
from trnflow.flows._params import resolve_spec
from trnflow.redact import MASK, Redactor, secret_values
from trnflow.specs import SpecError

QUICKSTART = EXAMPLES / "quickstart.yaml"


def test_the_spec_parameter_wins_and_a_url_is_read_from_a_path_or_s3(in_process_aws, make_spec):
    import boto3

    given = make_spec()
    assert resolve_spec(given, str(QUICKSTART)) is given  # a deployment's default spec_url does not override it
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


def test_secret_looking_variables_are_masked_in_relayed_lines():
    environ = {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG", "HF_TOKEN": "hf_abcdefgh", "DB_PASSWORD": "pw",
               "HOME": "/root", "WANDB_API_KEY": "0123456789abcdef"}
    assert set(secret_values(environ)) == {"wJalrXUtnFEMI/K7MDENG", "hf_abcdefgh", "0123456789abcdef"}  # pw: too short
    redact = Redactor(secret_values(environ))
    line = "uploading to s3 with wJalrXUtnFEMI/K7MDENG and hf_abcdefgh from /root"
    assert redact(line) == f"uploading to s3 with {MASK} and {MASK} from /root"
    assert Redactor([])("nothing to hide") == "nothing to hide"
