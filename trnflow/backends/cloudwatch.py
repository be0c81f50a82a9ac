"""A job's log lines from CloudWatch Logs, read from an event cursor (how many events were already
read), as the Backend protocol's `logs` asks. A `StreamReader` remembers the page token that ends
each cursor it returned, so a poll reads only what is new."""

from __future__ import annotations

from typing import Any

from trnflow import aws


class StreamReader:
    def __init__(self, logs: Any, group: str):
        self.logs, self.group = logs, group
        self._tokens: dict[tuple[str, int], str] = {}

    def read(self, stream: str, since: int) -> tuple[str, int]:
        """The stream's events after the first `since`, as text, and the new cursor."""
        kwargs: dict[str, Any] = {"logGroupName": self.group, "logStreamName": stream, "startFromHead": True}
        token = self._tokens.get((stream, since))
        skip = 0 if token else since  # without a token, start from the head and skip what was read
        if token:
            kwargs["nextToken"] = token
        events: list[str] = []
        while True:
            try:
                page = aws.call(self.logs.get_log_events, **kwargs)
            except self.logs.exceptions.ResourceNotFoundException:
                return "", since  # the job has not written anything yet
            events += [e["message"] for e in page["events"]]
            token = page.get("nextForwardToken")
            if not page["events"] or token == kwargs.get("nextToken"):
                break
            kwargs["nextToken"] = token
        new = events[skip:]
        cursor = since + len(new)
        if token and new:  # a token taken from an empty stream does not always lead to its first event
            self._tokens[(stream, cursor)] = token
        return "".join(m if m.endswith("\n") else m + "\n" for m in new), cursor


def streams(logs: Any, group: str, prefix: str) -> list[str]:
    """The log streams under `prefix`, by name."""
    try:
        page = aws.call(logs.describe_log_streams, logGroupName=group, logStreamNamePrefix=prefix)
    except logs.exceptions.ResourceNotFoundException:
        return []
    return sorted(s["logStreamName"] for s in page.get("logStreams", []))
