"""S3 faults to rehearse with: throttling (`SlowDown`) and 5xx answers, injected into the S3
clients trnflow makes (`trnflow.aws.client`) through botocore's `before-send` event, so the request
never reaches the server and the client parses the error as S3 would have sent it.

`TRNFLOW_S3_FAULTS` is a comma-separated list of `Code/N`: every N-th S3 request of the process
fails with that code (for example `SlowDown/3,InternalError/7`). A request that fails is retried
by `trnflow.aws.call`, the one retry owner for these errors. `TRNFLOW_S3_FAULTS_LOG`, if set,
names a file that gets a line per injected error, from every process.

The injector is off until `activate()` adds it to `trnflow.aws.CLIENT_HOOKS`. `environment()` gives
the variables that turn it on in every process a rehearsal starts (workers included): they put
this package's `site/` folder on PYTHONPATH, whose `sitecustomize` activates it at start-up.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import Any

from botocore.awsrequest import AWSResponse

from trnflow import aws
from trnflow.errors import FatalError

S3_FAULTS_ENV = "TRNFLOW_S3_FAULTS"
S3_FAULTS_LOG_ENV = "TRNFLOW_S3_FAULTS_LOG"
STATUS = {"SlowDown": 503, "ServiceUnavailable": 503, "InternalError": 500}

_requests = itertools.count(1)
_lock = threading.Lock()


def parse(text: str) -> list[tuple[str, int]]:
    """`SlowDown/3,InternalError/7` -> [("SlowDown", 3), ("InternalError", 7)]."""
    rules = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        code, _, every = item.partition("/")
        if code not in STATUS or not every.isdigit() or int(every) < 2:
            raise FatalError(f"{S3_FAULTS_ENV}: {item!r} is not Code/N with Code one of {', '.join(STATUS)} "
                             "and N >= 2 (every N-th request fails)")
        rules.append((code, int(every)))
    return rules


class _Body:
    def __init__(self, data: bytes):
        self._data = data

    def stream(self, **_: Any):
        yield self._data


def _error_response(code: str, url: str) -> Any:
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
            f"<Message>injected fault: {code}</Message></Error>").encode()
    return AWSResponse(url, STATUS[code], {"Content-Type": "application/xml"}, _Body(body))


def install(client: Any) -> None:
    """Inject the faults `TRNFLOW_S3_FAULTS` asks for into an S3 client (nothing when unset)."""
    rules = parse(os.environ.get(S3_FAULTS_ENV, ""))
    if not rules:
        return
    log = os.environ.get(S3_FAULTS_LOG_ENV)

    def before_send(request: Any, event_name: str, **_: Any) -> Any:
        with _lock:
            n = next(_requests)
        code = next((code for code, every in rules if n % every == 0), None)
        if code is None:
            return None
        if log:
            with open(log, "a") as fh:  # one short append per line: lines from many processes stay whole
                fh.write(f"{os.getpid()} {event_name.rsplit('.', 1)[-1]} {code}\n")
        return _error_response(code, request.url)

    client.meta.events.register("before-send.s3", before_send)


def _hook(service: str, client: Any) -> None:
    if service == "s3":
        install(client)


def activate() -> None:
    """Inject into every S3 client trnflow makes from now on in this process, while TRNFLOW_S3_FAULTS is set."""
    if _hook not in aws.CLIENT_HOOKS:
        aws.CLIENT_HOOKS.append(_hook)


SITE = Path(__file__).resolve().parent / "site"


def environment(faults: str, log: str | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The variables that inject `faults` into every process started with them."""
    base = os.environ if base is None else base
    path = os.pathsep.join(p for p in (str(SITE), base.get("PYTHONPATH", "")) if p)
    return {S3_FAULTS_ENV: faults, "PYTHONPATH": path, **({S3_FAULTS_LOG_ENV: log} if log else {})}
