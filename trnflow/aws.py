"""AWS clients, and the one place that retries their calls.

Throttling, 5xx answers and dropped connections are retried here, with exponential backoff and
jitter, and a log line per retry. Nothing else is: botocore's own retries are switched off so that
these failures have a single retry owner. Endpoints come from the usual AWS variables, so
`AWS_ENDPOINT_URL=http://127.0.0.1:5000` points every client at a moto server.

`InstanceMetadata` reads the EC2 instance metadata service (IMDSv2) from a job's container: which
instance it runs on, and EC2's spot reclaim notice.
"""

from __future__ import annotations

import http.client
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urlparse

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

T = TypeVar("T")
log = logging.getLogger("trnflow.aws")

ATTEMPTS = 6
FIRST_WAIT_SECONDS = 0.5
MAX_WAIT_SECONDS = 20.0
THROTTLING = {"Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
              "TooManyRequestsException", "SlowDown", "ProvisionedThroughputExceededException"}


TRANSIENT_CODES = THROTTLING | {"InternalError", "ServiceUnavailable"}
"""Error codes S3 gives for one key of a batch delete that another try can clear (throttling, a 5xx)."""


CLIENT_HOOKS: list[Callable[[str, Any], None]] = []
"""Called with each client this module makes (its service name and the client). Empty in the
product; a rehearsal adds its fault injector here (see trnflow.testing.s3faults)."""


def emulated() -> bool:
    """Whether AWS_ENDPOINT_URL points at a local emulator (a moto server on this machine)."""
    return urlparse(os.environ.get("AWS_ENDPOINT_URL", "")).hostname in ("127.0.0.1", "localhost", "::1")


_SESSIONS: dict[tuple, Any] = {}
_LOCK = threading.Lock()  # boto3 sessions are not thread-safe; the clients they make are


def session() -> Any:
    """The process's boto3 session for the current AWS settings (the `AWS_*` variables). One is
    kept per setting: each new session reads botocore's service models from disk again, about a
    quarter of a second of CPU for every client it makes. Pointed at a local AWS emulator
    (`AWS_ENDPOINT_URL` on 127.0.0.1) with no credentials or region configured, it uses
    placeholder ones: the emulator checks neither, and nothing can leave the machine with them."""
    import boto3  # ~0.3 s to import: only what talks to AWS pays for it
    from botocore.handlers import BUILTIN_HANDLERS

    # A library that adds botocore handlers (an AWS emulator in-process does) gets a new session:
    # sessions take the handlers there are when they are made.
    key = (tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))), len(BUILTIN_HANDLERS))
    with _LOCK:
        if key not in _SESSIONS:
            _SESSIONS[key] = _new_session(boto3)
        return _SESSIONS[key]


def _new_session(boto3: Any) -> Any:
    base = boto3.session.Session()
    if not emulated():
        return base
    kwargs: dict[str, str] = {}
    if base.get_credentials() is None:
        kwargs = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    if kwargs or base.region_name is None:
        return boto3.session.Session(region_name=base.region_name or "us-east-1", **kwargs)
    return base


def client(service: str, endpoint_url: str | None = None, boto_session: Any = None) -> Any:
    from botocore.config import Config  # botocore loads with boto3, lazily (see session)

    config = Config(retries={"total_max_attempts": 1}, connect_timeout=10, read_timeout=60)
    boto_session = boto_session or session()
    with _LOCK:
        made = boto_session.client(service, endpoint_url=endpoint_url, config=config)
    for hook in CLIENT_HOOKS:
        hook(service, made)
    return made


def is_retryable(exc: BaseException) -> bool:
    """Throttling, a 5xx answer or a connection that failed: worth another try."""
    from botocore.exceptions import ClientError, ConnectionError, ReadTimeoutError  # lazily, as boto3

    if isinstance(exc, ConnectionError | ReadTimeoutError):
        return True
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.get("Code") in THROTTLING or status >= 500
    return False


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, retried on throttling and 5xx only."""
    retrying = Retrying(
        retry=retry_if_exception(is_retryable),
        stop=stop_after_attempt(ATTEMPTS),
        wait=wait_exponential_jitter(initial=FIRST_WAIT_SECONDS, max=MAX_WAIT_SECONDS, jitter=FIRST_WAIT_SECONDS),
        reraise=True,
        before_sleep=lambda state: log.warning(
            "%s failed (%s); retrying in %.1fs (attempt %d/%d)", getattr(fn, "__name__", "AWS call"),
            state.outcome.exception() if state.outcome else "?", state.next_action.sleep if state.next_action else 0,
            state.attempt_number, ATTEMPTS),
    )
    return retrying(fn, *args, **kwargs)


IMDS_ENDPOINT = "http://169.254.169.254"
"""The EC2 instance metadata service (`AWS_EC2_METADATA_SERVICE_ENDPOINT` moves it, as for the AWS SDKs)."""
RECLAIM_NOTICE_ENV = "TRNFLOW_RECLAIM_NOTICE"
"""`imds`: the job's ranks read the spot reclaim notice from the metadata service (AWS Batch, which does
not signal a container before EC2 takes its spot instance back); unset: the notice is SIGTERM."""
IMDS_TOKEN_SECONDS = 21600
"""How long an IMDSv2 session token lasts (the most EC2 grants)."""


class InstanceMetadata:
    """This EC2 instance's metadata service, IMDSv2: a session token, kept until it expires (or the
    service refuses it), then the reads. Every read is None where the service does not answer: not
    on EC2, a container it is blocked from, SageMaker's containers, or a path it does not have (yet:
    the reclaim notice is a 404 until EC2 gives it). A service that did not answer at all is not
    asked again for `QUIET_SECONDS`, so a blocked one costs a job one timeout a minute, not one a step."""

    QUIET_SECONDS = 60.0

    def __init__(self, env: Mapping[str, str] | None = None, timeout: float = 1.0):
        env = os.environ if env is None else env
        self.base = env.get("AWS_EC2_METADATA_SERVICE_ENDPOINT", IMDS_ENDPOINT).rstrip("/")
        self.timeout = timeout
        self._token, self._until = "", 0.0
        self._quiet_until = 0.0 if self.base.startswith(("http://", "https://")) else math.inf

    @property
    def answers(self) -> bool:
        """Whether the service is being asked (it answered, or has not been asked yet)."""
        return time.monotonic() >= self._quiet_until

    def _open(self, path: str, headers: dict[str, str], method: str = "GET") -> str:
        request = urllib.request.Request(f"{self.base}{path}", method=method, headers=headers)  # noqa: S310
        with urllib.request.urlopen(request, timeout=self.timeout) as answer:  # noqa: S310 (http only, above)
            return answer.read().decode().strip()

    def get(self, key: str) -> str | None:
        """`meta-data/<key>` (`instance-id`, `spot/instance-action`), or None."""
        if not self.answers:
            return None
        try:
            if time.monotonic() >= self._until:
                self._token = self._open("/latest/api/token", {
                    "X-aws-ec2-metadata-token-ttl-seconds": str(IMDS_TOKEN_SECONDS)}, "PUT")
                self._until = time.monotonic() + IMDS_TOKEN_SECONDS - 60
            return self._open(f"/latest/meta-data/{key}", {"X-aws-ec2-metadata-token": self._token})
        except urllib.error.HTTPError as exc:  # 404: no such path (no notice yet)
            if exc.code == 401:  # the token was refused: take a new one next time
                self._until = 0.0
            return None
        except (OSError, http.client.HTTPException):  # no answer, a timeout, a cut connection
            self._quiet_until = time.monotonic() + self.QUIET_SECONDS
            return None

    def reclaim_notice(self) -> str | None:
        """EC2's spot interruption notice for this instance (`{"action": "terminate", "time": ...}`, two
        minutes ahead), or None while there is none."""
        return self.get("spot/instance-action")
