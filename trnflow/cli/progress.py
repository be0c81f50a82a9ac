"""Live progress bars for training and inference, drawn from the events the workload logs.

Every backend carries the workload's log lines into the stage task's Prefect log, each event as a
readable line that carries the event itself (`trnflow.events.EVENT_FIELD`); this handler listens
there and moves a rich progress bar on each `train` event (step, loss, samples/s) and each
`infer_shard` event (shards done, rows/s), so a terminal user sees the work advance while the task
log keeps every line.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trnflow.events import EVENT_FIELD, Late, Resumed, ShardDone, TrainTick, duration, progress_of


class TrainingProgress(logging.Handler):
    def __init__(self, progress: Progress):
        super().__init__()
        self.progress = progress
        self.bar = None
        self.shards = None
        self.late = ""

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, EVENT_FIELD, None)
        if isinstance(event, dict):
            self.show(event)

    def show(self, event: dict) -> None:
        """Move the bars on one event of the workload's."""
        tick = progress_of(event)
        if isinstance(tick, Resumed) and self.bar is not None:
            self.progress.update(self.bar, completed=tick.step, description=f"resumed at step {tick.step}")
        elif isinstance(tick, TrainTick):
            if self.bar is None:
                self.bar = self.progress.add_task("training", total=tick.steps, stage="train", eta="")
            left = f"{duration(tick.eta_s)} left" if tick.eta_s is not None else ""
            eta = ", ".join(t for t in (left, self.late) if t)
            self.progress.update(self.bar, total=tick.steps, completed=tick.step, eta=eta,
                                 description=f"loss {tick.loss:.4f}, {tick.samples_per_s:.0f} samples/s")
        elif isinstance(tick, Late) and self.bar is not None:
            self.late = f"late: {tick.forecast_minutes} min of {tick.deadline_minutes}"
            self.progress.update(self.bar, eta=self.late)
        elif isinstance(tick, ShardDone):
            if self.shards is None:
                self.shards = self.progress.add_task("embedding", total=tick.shards, stage="infer", eta="")
            self.progress.update(self.shards, advance=1, description=f"{tick.rows_per_s:.0f} rows/s (rank "
                                 f"{tick.rank})")


COLUMNS = (TextColumn("{task.fields[stage]}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
           TimeElapsedColumn(), TextColumn("{task.fields[eta]}"))


def _events(text: str) -> Iterator[dict]:
    """The workload's events among a job's log lines (JSON objects, one a line)."""
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    yield event


@contextlib.contextmanager
def job_progress(console: Console, what: str) -> Iterator[Callable[[str], None]]:
    """Follow a job run straight on a backend (`run_to_end`'s `on_logs`, given its new log lines): on
    a terminal, the bars `training_progress` draws; elsewhere, a line for each point of the training
    curve the job logs (`what: step 25/200, loss 0.6931, 120 samples/s, 1.2 min left`)."""
    if console.is_terminal:
        with Progress(*COLUMNS, console=console, transient=True) as progress:
            bars = TrainingProgress(progress)

            def drawn(text: str) -> None:
                for event in _events(text):
                    bars.show(event)

            yield drawn
        return

    def said(text: str) -> None:
        for event in _events(text):
            tick = progress_of(event)
            if isinstance(tick, TrainTick):
                left = f", {duration(tick.eta_s)} left" if tick.eta_s is not None else ""
                console.print(f"{what}: step {tick.step}/{tick.steps}, loss {tick.loss:.4f}, "
                              f"{tick.samples_per_s:.0f} samples/s{left}", markup=False, highlight=False)

    yield said


@contextlib.contextmanager
def training_progress(console: Console, enabled: bool = True) -> Iterator[None]:
    """Show a training progress bar on `console` while the block runs (transient: it is gone after)."""
    if not enabled:
        yield
        return
    loggers = [logging.getLogger("prefect.task_runs"), logging.getLogger("prefect.flow_runs")]
    with Progress(*COLUMNS, console=console, transient=True) as progress:
        handler = TrainingProgress(progress)
        for logger in loggers:
            logger.addHandler(handler)
        try:
            yield
        finally:
            for logger in loggers:
                logger.removeHandler(handler)
