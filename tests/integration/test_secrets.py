"""A secrets canary: secret values planted in the environment must appear in no log line, artifact,
flow-run message, job record or cloud request that trnflow writes; specs cannot carry credentials."""

import json

import pytest
from prefect import flow

from tests.conftest import quickstart_data
from trnflow.backends import JobRequest
from trnflow.backends.batch_request import build_job_definition, build_submit_job
from trnflow.backends.cloud import CloudTarget
from trnflow.backends.sagemaker_request import build_training_job_request
from trnflow.flows._stages import StageRunner, run_stages
from trnflow.redact import MASK
from trnflow.settings import TrnflowSettings
from trnflow.specs import SpecError, validate_spec
from trnflow.tasks.train import train_model

CANARY = "cnry-7d1e0c5b9a"
SECRETS = {"AWS_SECRET_ACCESS_KEY": f"{CANARY}-aws", "AWS_SESSION_TOKEN": f"{CANARY}-session",
           "HF_TOKEN": f"{CANARY}-hf", "DB_PASSWORD": f"{CANARY}-db"}
TARGET = CloudTarget(image="123456789012.dkr.ecr.us-east-1.amazonaws.com/trnflow:0.1.0",
                     staging_url="s3://acme-staging/trnflow", role_arn="arn:aws:iam::123456789012:role/trnflow-sm",
                     job_queue="trn1-fair-share")


@pytest.fixture
def planted(monkeypatch):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)


def _flow_run_text(flow_run_id) -> str:
    """Everything Prefect keeps of a flow run: its logs, artifacts, and the states' messages."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    ids = FlowRunFilterId(any_=[flow_run_id])
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(), flow_run_filter=FlowRunFilter(id=ids))
        run = client.read_flow_run(flow_run_id)
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=ids))
    parts = [log.message for log in logs] + [json.dumps(a.data, default=str) for a in artifacts]
    parts += [run.state.message or ""] + [t.state.message or "" for t in tasks if t.state]
    return "\n".join(parts)


def test_secret_values_reach_no_log_artifact_message_or_job_record(planted, prefect_api, make_spec, tmp_path):
    """A training job fails with an error that quotes a path holding a secret value: the job's
    log lines relayed to Prefect, the failure message, the summary artifact and the job's record
    all carry the mask instead."""
    leaky = tmp_path / SECRETS["HF_TOKEN"] / "train"  # echoed by the job's error message
    spec = make_spec(1, data={"train": str(leaky)}, retries={"max_retries": 0})

    @flow
    def one_stage():
        return run_stages(StageRunner(spec, "canary"), lambda stage: stage("train", train_model, [0]), ("train",))

    state = one_stage(return_state=True)
    assert state.is_failed()
    text = _flow_run_text(state.state_details.flow_run_id)
    assert "no such folder" in text and MASK in text  # the error arrived, masked
    assert CANARY not in text
    assert CANARY not in str(state.result(raise_on_failure=False))
    for job in TrnflowSettings().jobs_dir.glob("*train*/job.json"):  # the request as sent
        assert CANARY not in job.read_text()


def test_cloud_requests_carry_no_secret_from_the_environment(planted):
    spec = validate_spec(quickstart_data(
        data={"train": "s3://acme-data/train", "holdout": "s3://acme-data/holdout", "inference": "s3://acme-data/inf"},
        compute={"backend": "batch", "instance_type": "trn1.32xlarge", "nodes": 2, "cores_per_node": 16},
        compile={"cache_url": "s3://acme-cache/neuron"}, registry_url="s3://acme-models/registry",
        train={"checkpoint_url": "s3://acme-ckpt/runs"}, gate={"reference": "champion"},
        inference={"output_url": "s3://acme-out/emb"}))
    request = JobRequest(spec, "train", "r1")
    sent = [build_training_job_request(request, TARGET), build_job_definition(spec, TARGET),
            build_submit_job(request, TARGET, "trnflow-quickstart-1")]
    assert CANARY not in json.dumps(sent)


@pytest.mark.parametrize("url", ["s3://AKIAEXAMPLE:cnry-7d1e0c5b9a@bucket/data", "file://me:cnry-7d1e0c5b9a@host/x"])
def test_a_spec_cannot_carry_credentials_in_a_url_and_the_error_does_not_repeat_them(url):
    with pytest.raises(SpecError) as caught:
        validate_spec(quickstart_data(data={"train": url}))
    assert "data.train: credentials in a" in str(caught.value) and "remove them" in str(caught.value)
    assert CANARY not in str(caught.value)


def test_published_artifacts_carry_no_secret_in_any_form(planted, prefect_api, make_spec, monkeypatch):
    """What a stage publishes (Markdown, a link, a table) is masked as its log lines are: the session
    token URL-encoded in a presigned link, a database URL's password in a table cell."""
    from urllib.parse import quote

    from trnflow.tasks import _artifacts

    monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"postgresql+asyncpg://prefect:{CANARY}-pg@db/prefect")
    spec = make_spec()
    presigned = f"https://b.s3.amazonaws.com/k?X-Amz-Security-Token={quote(SECRETS['AWS_SESSION_TOKEN'] + '/+=')}"

    @flow
    def publish():
        _artifacts.markdown(spec, "notes", f"read from {presigned}", "notes")
        _artifacts.link(spec, "where", f"s3://out/{SECRETS['HF_TOKEN']}/emb", "embeddings")
        _artifacts.table(spec, "rows", [{"stage": "train", "note": f"db pass {CANARY}-pg", "steps": 3}], "rows")

    state = publish(return_state=True)
    assert state.is_completed()
    text = _flow_run_text(state.state_details.flow_run_id)
    assert text.count(MASK) >= 3 and 'steps' in text
    assert CANARY not in text
