"""The EC2 instances the emulated services start for a job attempt.

Each is minted in moto's EC2 (`RunInstances`), so its id and type are EC2's own, and gets an
instance metadata service of its own (IMDSv2: a session token, then `meta-data/instance-id` and
`instance-type`, and `spot/instance-action` once a spot instance is to be reclaimed), which its
container reaches at `AWS_EC2_METADATA_SERVICE_ENDPOINT` as it would reach 169.254.169.254. A
job's attempts keep them (a retry is placed on the instances already there) unless they were
terminated; the job's end terminates them. Every start is counted.
"""

from __future__ import annotations

import json
import secrets
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

IMAGE_ID = "ami-12c6146b"
"""An AMI moto's EC2 knows (the instances run nothing: their containers are this machine's processes)."""
TOKEN_HEADER = "X-aws-ec2-metadata-token"  # noqa: S105 (a header name)


SPOT_NOTICE = "/latest/meta-data/spot/instance-action"
"""Where EC2's two-minute spot interruption notice appears (404 until then)."""


@dataclass
class Instance:
    instance_id: str
    instance_type: str
    server: ThreadingHTTPServer = field(repr=False)
    answers: dict[str, str] = field(repr=False, default_factory=dict)
    """What its metadata service answers, by path."""
    asked: list[str] = field(repr=False, default_factory=list)
    """Every request its metadata service got (`PUT /latest/api/token`, `GET /latest/meta-data/...`)."""

    @property
    def endpoint(self) -> str:
        """Where the instance's metadata service answers (AWS_EC2_METADATA_SERVICE_ENDPOINT)."""
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def notify_reclaim(self, seconds: float = 120.0) -> None:
        """EC2's spot interruption notice: the instance will be terminated in `seconds`."""
        when = datetime.now(UTC) + timedelta(seconds=seconds)
        self.answers[SPOT_NOTICE] = json.dumps({"action": "terminate", "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")})


def _metadata_server(answers: dict[str, str], asked: list[str]) -> ThreadingHTTPServer:
    token = secrets.token_hex(16)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self) -> None:
            asked.append(f"PUT {self.path}")
            if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                self._send(200, token)
            else:
                self._send(400, "")

        def do_GET(self) -> None:
            asked.append(f"GET {self.path}")
            if self.headers.get(TOKEN_HEADER) != token:
                self._send(401, "")  # IMDSv2 only, as the deployment's launch template requires
            elif self.path in answers:
                self._send(200, answers[self.path])
            else:
                self._send(404, "")

        def log_message(self, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="imds", daemon=True).start()
    return server


class Instances:
    """The instances of the mock cloud's job attempts, and how many were ever started."""

    def __init__(self, ec2: Any):
        self._ec2 = ec2
        self._lock = threading.Lock()
        self.started: list[str] = []
        """Every instance id started, in order."""

    def start(self, instance_type: str, count: int) -> list[Instance]:
        if count <= 0:
            return []
        answer = self._ec2.run_instances(ImageId=IMAGE_ID, MinCount=count, MaxCount=count,
                                         InstanceType=instance_type)
        ids = [i["InstanceId"] for i in answer["Instances"]]
        with self._lock:
            self.started += ids
        started = []
        for i in ids:
            answers = {"/latest/meta-data/instance-id": i, "/latest/meta-data/instance-type": instance_type}
            asked: list[str] = []
            started.append(Instance(i, instance_type, _metadata_server(answers, asked), answers, asked))
        return started

    def gone(self, instances: list[Instance]) -> list[Instance]:
        """Those no longer running in EC2 (terminated by someone)."""
        if not instances:
            return []
        answer = self._ec2.describe_instances(InstanceIds=[i.instance_id for i in instances])
        running = {i["InstanceId"] for r in answer["Reservations"] for i in r["Instances"]
                   if i["State"]["Name"] == "running"}
        return [i for i in instances if i.instance_id not in running]

    def stop(self, instances: list[Instance]) -> None:
        for instance in instances:
            instance.server.shutdown()
            instance.server.server_close()
        if instances:
            self._ec2.terminate_instances(InstanceIds=[i.instance_id for i in instances])
