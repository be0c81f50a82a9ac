"""An S3 prefix as a `Store`.

A put is atomic in S3 (readers see the old object or the new one), and `create` uses a conditional
put (`If-None-Match: *`), so two writers racing for the same name cannot both win. Calls go
through `trnflow.aws`, which retries throttling and 5xx answers.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from trnflow import aws
from trnflow.errors import FatalError, TransientError
from trnflow.storage.base import ObjectInfo


def split_s3_url(url: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix/")."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


SPOOL_BYTES = 32 << 20
"""How much of an opened object is held in memory before the rest goes to a temporary file."""


class S3Store:
    def __init__(self, url: str, client: Any = None):
        self.url = url.rstrip("/")
        self.bucket, self.prefix = split_s3_url(url)
        self._s3 = client or aws.client("s3")

    def _key(self, name: str) -> str:
        if name.startswith("/") or ".." in name.split("/"):
            raise ValueError(f"{name!r} is outside the store {self.url}")
        return self.prefix + name

    def read(self, name: str) -> bytes:
        try:
            return aws.call(self._s3.get_object, Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except self._s3.exceptions.NoSuchKey:
            raise FileNotFoundError(f"{self.url}/{name}") from None

    def open(self, name: str) -> BinaryIO:
        """The object copied, 1 MiB at a time, into a temporary file that stays in memory up to
        SPOOL_BYTES and is on local disk beyond (Parquet is read from its end, so a stream will not do).
        A download cut short is retried whole, like any call."""
        def download() -> BinaryIO:
            body = self._s3.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
            spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 (the caller closes it)
            try:
                shutil.copyfileobj(body, spool, 1 << 20)
            except BaseException:
                spool.close()
                raise
            spool.seek(0)
            return spool

        try:
            return aws.call(download)
        except self._s3.exceptions.NoSuchKey:
            raise FileNotFoundError(f"{self.url}/{name}") from None

    def write(self, name: str, data: bytes) -> None:
        aws.call(self._s3.put_object, Bucket=self.bucket, Key=self._key(name), Body=data)

    @contextlib.contextmanager
    def writing(self, name: str) -> Iterator[BinaryIO]:
        """The object spooled to a temporary file on local disk, and uploaded (in parts, when large)
        once the block ends; an upload cut short is retried whole, like any call."""
        key = self._key(name)
        with tempfile.TemporaryFile() as spool:
            yield spool

            def upload() -> None:
                spool.seek(0)
                self._s3.upload_fileobj(spool, self.bucket, key)

            aws.call(upload)

    def create(self, name: str, data: bytes) -> bool:
        """A conditional put (If-None-Match). When a retried put is refused because the object
        exists, an earlier attempt may have landed and lost only its answer (a 5xx after the write):
        the object is then this caller's if it holds exactly `data`, which callers make unique."""
        from botocore.exceptions import ClientError  # lazily, as trnflow.aws loads boto3

        attempts = 0

        def put_object() -> None:
            nonlocal attempts
            attempts += 1
            self._s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*")

        try:
            aws.call(put_object)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise
            if attempts == 1:
                return False
            try:
                return self.read(name) == data
            except FileNotFoundError:  # deleted meanwhile: whoever held it has let go, but not to us
                return False
        return True

    def delete(self, name: str) -> None:
        aws.call(self._s3.delete_object, Bucket=self.bucket, Key=self._key(name))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        found, token = [], None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = aws.call(self._s3.list_objects_v2, Bucket=self.bucket, Prefix=self._key(prefix), **extra)
            for obj in page.get("Contents", []):
                found.append(ObjectInfo(obj["Key"][len(self.prefix):], obj["Size"], obj["LastModified"].timestamp()))
            if not page.get("IsTruncated"):
                return sorted(found, key=lambda o: o.name)
            token = page["NextContinuationToken"]

    def delete_prefix(self, prefix: str) -> None:
        names = [o.name for o in self.list(prefix)]
        for start in range(0, len(names), 1000):
            self._delete_keys([self._key(n) for n in names[start:start + 1000]])

    def _delete_keys(self, keys: list[str]) -> None:
        """Delete up to 1,000 keys in one request. S3 answers such a request with success and lists the
        keys it could not delete: those whose error is throttling or a 5xx are tried again (with the
        waits `trnflow.aws` gives whole requests), then TransientError; AccessDenied raises
        PermissionError and any other code FatalError, each naming the key."""
        for attempt in range(1, aws.ATTEMPTS + 1):
            answer = aws.call(self._s3.delete_objects, Bucket=self.bucket,
                              Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True})
            errors = answer.get("Errors", [])
            lasting = [e for e in errors if e.get("Code") not in aws.TRANSIENT_CODES]
            if lasting:
                e = lasting[0]
                text = (f"s3://{self.bucket}/{e.get('Key')}: not deleted ({e.get('Code')}: {e.get('Message')}); "
                        f"{len(errors)} of {len(keys)} key(s) were refused")
                if e.get("Code") == "AccessDenied":
                    raise PermissionError(f"{text}. Check that this job may s3:DeleteObject there")
                raise FatalError(text)
            if not errors:
                return
            keys = [e["Key"] for e in errors]
            if attempt < aws.ATTEMPTS:
                time.sleep(min(aws.MAX_WAIT_SECONDS, aws.FIRST_WAIT_SECONDS * 2**attempt * random.uniform(0.5, 1)))
        raise TransientError(f"s3://{self.bucket}: {len(keys)} key(s) still not deleted after {aws.ATTEMPTS} tries "
                             f"(throttled or 5xx), the first {keys[0]}; try again later")
