"""A job's log lines from CloudWatch Logs, read from an event cursor (how many events were already
read), as the Backend protocol's `logs` asks."""

from __future__ import annotations

from typing import Any

from trnflow import aws


def read_stream(logs: Any, group: str, stream: str, since: int) -> tuple[str, int]:
    """The stream's events after the first `since`, as text, and the new cursor."""
    events: list[str] = []
    kwargs: dict[str, Any] = {"logGroupName": group, "logStreamName": stream, "startFromHead": True}
    while True:
        try:
            page = aws.call(logs.get_log_events, **kwargs)
        except logs.exceptions.ResourceNotFoundException:
            return "", since  # the job has not written anything yet
        events += [e["message"] for e in page["events"]]
        token = page.get("nextForwardToken")
        if not page["events"] or token == kwargs.get("nextToken"):
            break
        kwargs["nextToken"] = token
    new = events[since:]
    return "".join(m if m.endswith("\n") else m + "\n" for m in new), since + len(new)


def first_stream(logs: Any, group: str, prefix: str) -> str | None:
    """The first log stream (by name) under `prefix`: the main host's, for SageMaker."""
    try:
        page = aws.call(logs.describe_log_streams, logGroupName=group, logStreamNamePrefix=prefix)
    except logs.exceptions.ResourceNotFoundException:
        return None
    names = sorted(s["logStreamName"] for s in page.get("logStreams", []))
    return names[0] if names else None
