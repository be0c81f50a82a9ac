"""Every job a run launched and what it bills, failed attempts and retries included.

The ledger is a file per run, `<TRNFLOW_HOME>/ledger/<run id>.jsonl`, a JSON line per finished job,
appended by the task that ran the job and read by the flow that costs each stage. It lives on disk
rather than in memory so that any process of the run can add to it and a reader can never miss a
job that ran in another thread.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class LedgerEntry:
    phase: str
    job_id: str
    state: str
    seconds: float
    """Billable seconds per node (zero for a job that never started)."""
    nodes: int | None = None
    """The instances the job held (`trnflow.backends.cloud.placement` of its request); None in
    entries written before trnflow recorded it, which are billed on the spec's nodes."""
    instance_type: str | None = None
    """The instance type the job got (one of compute.instance_preferences); None: the spec's."""
    spot: bool = False
    """Whether the job ran on spot capacity (its `seconds` are what the service billed for it)."""
    running_seconds: float | None = None
    """A spot job's running time per node, of which `seconds` were billed; None: as `seconds`."""
    instances_started: int | None = None
    """The instances the job started, its retries' and restarts' included; None where there are none
    to count (a local job) or the service does not say."""
    provisioning_seconds: float | None = None
    """How long the job waited for the instances it started to be ready (boot, image pull)."""
    price_per_hour: float | None = None
    """The hourly price the job's instances were billed at where the service says it (EC2's spot price,
    for a Batch spot job); None: the price table's, or compute.price_per_hour."""


class JobLedger:
    def __init__(self, home: Path, run_id: str, start: int = 0):
        """A reader of run `run_id`'s jobs recorded after `start` (another reader's `read_up_to`)."""
        self.path = home.expanduser().resolve() / "ledger" / f"{run_id}.jsonl"
        self._read = start

    def record(self, entry: LedgerEntry) -> None:
        """Append one job. One short `write` of a whole line: lines from many writers stay whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(asdict(entry)) + "\n").encode())
        finally:
            os.close(fd)

    @property
    def read_up_to(self) -> int:
        """Where this reader has read to."""
        return self._read

    def new_entries(self) -> list[LedgerEntry]:
        """The jobs recorded since this reader last looked."""
        try:
            with self.path.open("rb") as fh:
                fh.seek(self._read)
                data = fh.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next look
        self._read += len(whole)
        return [LedgerEntry(**json.loads(line)) for line in whole.decode().splitlines() if line.strip()]
