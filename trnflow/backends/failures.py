"""Which of a failed job's rank reports is the root cause: a rank's own error comes before its
peers' complaints about the broken link, and a rank that died without a word (SIGKILL, the OOM
killer) is a lost worker, which a retry can cure. Shared by the local backend and the cloud
container, so both classify a failure alike.

Where torchrun's record of how each rank ended is at hand (`read_exits`), the ranks it stopped
itself once the first had failed are told apart from the one that failed, so a failure names that
rank alone, with its exit code or signal and the last lines of its own log (`name_first_rank`).
Among ranks of one kind of failure, the first to fail comes first: by when its report was written,
or, for a rank that wrote none, when torchrun saw it end."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

from trnflow.backends.launcher import EXITS
from trnflow.records import read
from trnflow.results import FailureReport

_PEER_SIGNS = ("Connection closed by peer", "Connection reset by peer", "gloo", "Broken pipe")
_TIMEOUT_SIGNS = ("Application timeout caused pair closure", "Timed out waiting")
TAIL_LINES = 12


@dataclass(frozen=True)
class RankExit:
    """How one rank's process ended, as torchrun saw it."""

    rank: int
    exitcode: int
    observed: float
    """When torchrun saw it end (seconds since the epoch; torchrun keeps whole seconds)."""
    logs: str = ""
    """The folder of its stdout.log and stderr.log."""

    @property
    def signal(self) -> str | None:
        """The signal that ended it (SIGKILL), or None when it exited with a code."""
        if self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    @property
    def how(self) -> str:
        """`signal SIGKILL` or `exit code 1`, as a failure message says it."""
        return f"signal {self.signal}" if self.signal else f"exit code {self.exitcode}"

    @property
    def stopped(self) -> bool:
        """Ended by SIGTERM: how torchrun stops the other ranks once one has failed."""
        return self.exitcode == -signal.SIGTERM


def lost_peer(report: FailureReport) -> bool:
    """Whether a rank's error only says that a peer went away."""
    return report.type == "DistBackendError" or any(sign in str(report) for sign in _PEER_SIGNS)


def report_order(report: FailureReport) -> tuple:
    """Sorts reports root cause first: a rank's own error (its `retryable` said), then one that is not
    only a lost peer, then the first written, then the lowest rank."""
    return report.retryable is None, lost_peer(report), report.reported_at or 0.0, report.rank or 0


def read_reports(output_dir: Path) -> list[FailureReport]:
    """Each failing rank's own report, with `reported_at`: when the rank wrote it."""
    reports = []
    for path in sorted(output_dir.glob("failure-rank*.json")):
        report = read(FailureReport, path.read_bytes(), str(path))
        reports.append(report.model_copy(update={"reported_at": path.stat().st_mtime}))
    return reports


def read_exits(folder: Path) -> list[RankExit]:
    """torchrun's record of how the ranks that failed ended; empty when there is none (the job
    succeeded, or its launcher itself was killed)."""
    try:
        record = json.loads((folder / EXITS).read_text())
        return [RankExit(int(r["rank"]), int(r["exitcode"]), float(r["observed"]), str(r.get("logs", "")))
                for r in record["ranks"]]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return []


def _first(reports: list[FailureReport]) -> FailureReport:
    """The report written first (then the lowest rank)."""
    return min(reports, key=lambda r: (r.reported_at or 0.0, r.rank or 0))


def _failed_alone(exits: list[RankExit]) -> list[RankExit]:
    """The ranks that ended by themselves: not the ones torchrun stopped after the first failure
    (unless every rank ended that way, when none can be told from the others)."""
    own = [e for e in exits if not e.stopped]
    return own or list(exits)


def root_failure(reports: list[FailureReport], processes: int, first_rank: int = 0,
                 exits: list[RankExit] | None = None) -> FailureReport:
    """The failure that caused the others among ranks `first_rank`.. of `processes` ranks;
    `retryable` says whether a retry can help. `exits` (torchrun's record, where it is at hand)
    narrows a silent death down to the rank that died first."""
    own = [r for r in reports if r.retryable is not None]
    if own:
        return _first(own)
    waited = [r for r in reports if r.type in ("RuntimeError", "DistBackendError")
              and any(sign in r.message for sign in _TIMEOUT_SIGNS)]
    causes = [r for r in reports if not lost_peer(r) and r not in waited]
    if causes:
        return _first(causes)  # a plain error (a bug): not retryable
    silent = sorted(set(range(first_rank, first_rank + processes)) - {r.rank for r in reports})
    if waited:  # the ranks that reported timed out waiting for the silent ones
        who = f"rank(s) {silent} stopped answering" if silent else "the ranks waited for each other"
        return FailureReport(type="CollectiveTimeout", retryable=True, ranks=silent,
                             message=f"{who}: rank(s) {[r.rank for r in waited]} timed out waiting in a collective "
                                     f"({waited[0].message}); a retry resumes from the last checkpoint")
    died = sorted((e for e in _failed_alone(exits or []) if e.rank in silent), key=lambda e: (e.observed, e.rank))
    if died:
        return FailureReport(type="WorkerLost", retryable=True, ranks=[died[0].rank],
                             message=f"rank {died[0].rank} exited without reporting why ({died[0].how}; killed, or "
                                     "out of memory)")
    return FailureReport(type="WorkerLost", retryable=True, ranks=silent,
                         message=f"rank(s) {silent} exited without reporting why (killed, or out of memory)")


def failed_rank(failure: FailureReport) -> int | None:
    """The one rank a failure is about, or None when it names several (or none)."""
    if failure.rank is not None:
        return failure.rank
    return failure.ranks[0] if len(failure.ranks) == 1 else None


def log_tail(logs: str, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` lines a rank wrote to stdout, then to stderr (where its error is), from
    the folder torchrun kept its output in."""
    tail: list[str] = []
    for name in ("stdout.log", "stderr.log"):
        try:
            text = (Path(logs) / name).read_text(errors="replace") if logs else ""
        except FileNotFoundError:
            continue
        tail += text.splitlines()[-lines:]
    return tail


def name_first_rank(failure: FailureReport, exits: list[RankExit]) -> FailureReport:
    """The failure with what torchrun knows of the rank it is about: its exit code or signal and
    the last lines of its log (where it has a log of its own: not when the ranks wrote to the
    launcher's output, as in a container). The failure as it is when torchrun recorded nothing of
    that rank."""
    rank = failed_rank(failure)
    ended = next((e for e in exits if e.rank == rank), None)
    if ended is None:
        return failure
    how = {"exitcode": ended.exitcode, "signal": ended.signal}
    if not ended.logs:
        return failure.model_copy(update=how)
    tail = log_tail(ended.logs)
    lines = "\n".join(f"    {line}" for line in tail) if tail else "    (it wrote nothing)"
    return failure.model_copy(update={**how, "message": f"{failure.message}\nrank {rank} failed first "
                                      f"({ended.how}); the last lines of its log ({ended.logs}):\n{lines}"})
