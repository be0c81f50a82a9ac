"""The object stores behind the compile cache: a directory and an S3 prefix (moto), one contract."""

import os

import pytest
from botocore.exceptions import ClientError
from moto import mock_aws

from trnflow import aws
from trnflow.errors import TransientError
from trnflow.storage import LocalStore
from trnflow.storage.s3 import S3Store


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, monkeypatch):
    if request.param == "local":
        yield LocalStore(tmp_path / "store")
        return
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with mock_aws():
        aws.client("s3").create_bucket(Bucket="cache-bucket")
        yield S3Store("s3://cache-bucket/some/prefix")


def test_both_stores_keep_the_same_contract(store):
    with pytest.raises(FileNotFoundError):
        store.read("a/missing")
    store.write("a/b/one", b"1")
    store.write("a/b/one", b"11")  # replaced whole
    assert store.read("a/b/one") == b"11"
    with store.open("a/b/one") as f:  # read a part at a time, and seek
        assert f.read(1) == b"1" and f.seek(0) == 0 and f.read() == b"11"
    with pytest.raises(FileNotFoundError):
        store.open("a/missing")
    with store.writing("a/b/one") as f:  # written a part at a time, replaced whole at the end
        f.write(b"2" * 10)
        f.write(memoryview(b"3" * 5))
        assert store.read("a/b/one") == b"11"
    assert store.read("a/b/one") == b"2" * 10 + b"3" * 5
    with pytest.raises(RuntimeError, match="cut short"), store.writing("a/b/one") as f:
        f.write(b"half")
        raise RuntimeError("cut short")
    assert store.read("a/b/one") == b"2" * 10 + b"3" * 5  # as it was
    store.write("a/b/one", b"11")
    assert store.create("a/lock", b"mine") is True
    assert store.create("a/lock", b"theirs") is False  # the second writer loses and is told
    assert store.read("a/lock") == b"mine"
    store.write("z/other", b"x")
    assert [(o.name, o.size) for o in store.list("a/")] == [("a/b/one", 2), ("a/lock", 4)]  # no temporary file
    store.delete("a/lock")
    store.delete("a/lock")  # deleting what is gone is harmless
    store.delete_prefix("a/")
    assert [o.name for o in store.list()] == ["z/other"]
    with pytest.raises(ValueError, match="outside the store"):
        store.read("../escape")


def test_an_s3_object_opened_for_reading_goes_to_disk_beyond_the_spool_size(in_process_aws, monkeypatch):
    from trnflow.storage import s3

    monkeypatch.setattr(s3, "SPOOL_BYTES", 1000)
    aws.client("s3").create_bucket(Bucket="data")
    store = S3Store("s3://data/train")
    data = os.urandom(5000)
    store.write("part-0.parquet", data)
    with store.open("part-0.parquet") as f:
        assert f._rolled  # a real file on local disk, not 5,000 bytes in memory
        f.seek(-10, os.SEEK_END)
        assert f.read() == data[-10:]
        f.seek(0)
        assert f.read() == data


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")


def test_only_throttling_and_server_errors_are_retried(monkeypatch):
    monkeypatch.setattr(aws, "FIRST_WAIT_SECONDS", 0.0)
    monkeypatch.setattr(aws, "MAX_WAIT_SECONDS", 0.0)
    assert aws.is_retryable(_client_error("SlowDown", 503))
    assert aws.is_retryable(_client_error("ThrottlingException", 400))
    assert aws.is_retryable(_client_error("InternalError", 500))
    assert not aws.is_retryable(_client_error("AccessDenied", 403))
    assert not aws.is_retryable(_client_error("NoSuchKey", 404))

    answers = [_client_error("SlowDown", 503), _client_error("InternalError", 500), "ok"]

    def flaky():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert aws.call(flaky) == "ok" and answers == []
    with pytest.raises(ClientError, match="AccessDenied"):
        aws.call(lambda: (_ for _ in ()).throw(_client_error("AccessDenied", 403)))


def test_clients_share_a_session_while_the_aws_settings_stay_the_same(in_process_aws, monkeypatch):
    """A new boto3 session reads the service models again (a quarter of a second a client): the
    same settings reuse one, and a changed setting gets one of its own, with the new value."""
    first = aws.session()
    assert aws.session() is first
    first_bucket = aws.client("s3")
    first_bucket.create_bucket(Bucket="shared")
    assert "shared" in [b["Name"] for b in aws.client("s3").list_buckets()["Buckets"]]  # the same mocked account

    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    moved = aws.session()
    assert moved is not first and moved.region_name == "eu-west-1"
    assert aws.client("sqs").meta.region_name == "eu-west-1"
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert aws.session() is first


@pytest.mark.parametrize("code", ["SlowDown", "InternalError"])
def test_injected_s3_errors_on_reads_and_writes_are_retried_and_lose_nothing(code, in_process_aws, monkeypatch,
                                                                            tmp_path):
    from trnflow.testing import s3faults
    from trnflow.testing.s3faults import parse

    log = tmp_path / "injected.log"
    monkeypatch.setattr(aws, "CLIENT_HOOKS", [])
    s3faults.activate()
    monkeypatch.setenv("TRNFLOW_S3_FAULTS", f"{code}/3")
    monkeypatch.setenv("TRNFLOW_S3_FAULTS_LOG", str(log))
    monkeypatch.setattr(aws, "FIRST_WAIT_SECONDS", 0.0)
    client = aws.client("s3")
    aws.call(client.create_bucket, Bucket="rehearsal")
    store = S3Store("s3://rehearsal/run", client=client)
    for i in range(6):
        store.write(f"part-{i}", bytes([i]) * 10)
    assert [store.read(f"part-{i}") for i in range(6)] == [bytes([i]) * 10 for i in range(6)]
    assert [o.name for o in store.list()] == [f"part-{i}" for i in range(6)]
    injected = [line.split()[1:] for line in log.read_text().splitlines()]
    assert {op for op, _ in injected} >= {"PutObject", "GetObject"} and {c for _, c in injected} == {code}
    with pytest.raises(ClientError, match=code):  # outside trnflow.aws.call nothing retries it
        for _ in range(3):
            client.head_bucket(Bucket="rehearsal")
    with pytest.raises(Exception, match="TRNFLOW_S3_FAULTS: 'SlowDown/1' is not Code/N"):
        parse("SlowDown/1")


def test_a_conditional_put_that_landed_but_lost_its_answer_is_still_the_callers(in_process_aws, monkeypatch):
    """S3 wrote the object, then the answer was a 500: the retry is refused (the object exists),
    and the store tells its own object from someone else's by its content."""
    monkeypatch.setattr(aws, "FIRST_WAIT_SECONDS", 0.0)
    client = aws.client("s3")
    aws.call(client.create_bucket, Bucket="lossy")
    store = S3Store("s3://lossy/run", client=client)
    lost = []

    def lose_the_first_answer(http_response, parsed, **_):
        if not lost:
            lost.append(parsed["ResponseMetadata"]["HTTPStatusCode"])
            http_response.status_code = parsed["ResponseMetadata"]["HTTPStatusCode"] = 500
            parsed["Error"] = {"Code": "InternalError", "Message": "answer lost after the write"}

    client.meta.events.register("after-call.s3.PutObject", lose_the_first_answer)
    assert store.create("registry/v000001.json", b"run A") is True
    assert lost == [200] and store.read("registry/v000001.json") == b"run A"
    store.write("registry/v000002.json", b"run B")  # another writer's
    assert store.create("registry/v000002.json", b"run A") is False  # refused at once
    lost.clear()
    assert store.create("registry/v000002.json", b"run A") is False  # refused after a retry, and still not ours
    assert lost == [412] and store.read("registry/v000002.json") == b"run B"


def _refusing(client, refusals: dict[str, list[str]]):
    """Make S3 refuse keys of a batch delete, as it does per key: each request spares the keys next
    in `refusals` (key -> the codes of its next refusals), which S3 then lists as errors."""
    asked: list[list[str]] = []
    refused: list[tuple[str, str]] = []

    def leave_out(params, **_):
        keys = [o["Key"] for o in params["Delete"]["Objects"]]
        asked.append(keys)
        refused[:] = [(k, refusals[k].pop(0)) for k in keys if refusals.get(k)]
        for o in params["Delete"]["Objects"]:  # asked for another, absent key instead: S3 deletes nothing there
            o["Key"] += ".kept" if o["Key"] in dict(refused) else ""

    def answer(parsed, **_):
        parsed["Errors"] = [{"Key": k, "Code": code, "Message": f"{code} (rehearsed)"} for k, code in refused]

    client.meta.events.register("before-parameter-build.s3.DeleteObjects", leave_out)
    client.meta.events.register("after-call.s3.DeleteObjects", answer)
    return asked, lambda: (client.meta.events.unregister("before-parameter-build.s3.DeleteObjects", leave_out),
                           client.meta.events.unregister("after-call.s3.DeleteObjects", answer))


def test_keys_a_batch_delete_could_not_delete_are_retried_or_named(in_process_aws, monkeypatch):
    """A delete of a prefix answers 200 with the keys it could not delete: throttled ones are tried
    again until they are gone; a refused one raises, naming it, and is still there."""
    monkeypatch.setattr(aws, "FIRST_WAIT_SECONDS", 0.0)
    client = aws.client("s3")
    aws.call(client.create_bucket, Bucket="refusing")
    store = S3Store("s3://refusing/run", client=client)
    for name in ("a", "b", "c"):
        store.write(f"step/{name}", b"x")
    asked, undo = _refusing(client, {"run/step/b": ["SlowDown", "InternalError"]})
    store.delete_prefix("step/")
    assert store.list("step/") == [] and asked == [["run/step/a", "run/step/b", "run/step/c"], ["run/step/b"],
                                                   ["run/step/b"]]
    undo()
    for name in ("a", "b"):
        store.write(f"step/{name}", b"x")
    _, undo = _refusing(client, {"run/step/b": ["AccessDenied"]})
    with pytest.raises(PermissionError, match=r"s3://refusing/run/step/b: not deleted \(AccessDenied"):
        store.delete_prefix("step/")
    assert [o.name for o in store.list("step/")] == ["step/b"]
    undo()
    _refusing(client, {"run/step/b": ["InternalError"] * aws.ATTEMPTS})  # 5xx every time: try again later
    with pytest.raises(TransientError, match="1 key\\(s\\) still not deleted after"):
        store.delete_prefix("step/")


def test_a_full_disk_is_a_clear_error_that_leaves_the_old_file_whole(tmp_path, monkeypatch):
    import errno
    import os

    from trnflow.errors import DiskFull
    from trnflow.fsutil import atomic_write_bytes

    target = tmp_path / "step-000030" / "model.pt"
    atomic_write_bytes(target, b"old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(DiskFull, match=r"no space left on the device writing .*model.pt: free space there"):
        atomic_write_bytes(target, b"new" * 1000)
    assert target.read_bytes() == b"old" and [p.name for p in target.parent.iterdir()] == ["model.pt"]
    assert not DiskFull.retryable  # the same disk would fill again: the operator frees space and reruns


def test_the_fault_environment_turns_the_injector_on_in_every_process_it_starts():
    """Workers are separate processes: the variables alone must turn the injector on there."""
    import subprocess
    import sys

    from trnflow.testing import s3faults

    probe = "import trnflow.aws as aws; print([h.__module__ for h in aws.CLIENT_HOOKS])"
    env = {**os.environ, **s3faults.environment("SlowDown/3")}
    hooked = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert hooked.stdout.strip() == "['trnflow.testing.s3faults']" and plain.stdout.strip() == "[]"
