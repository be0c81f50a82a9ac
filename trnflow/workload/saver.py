"""Checkpoints written in the background (`train.checkpoint_async`).

At a step boundary the training loop copies the checkpoint's state into host memory (`stage`, or
the writer process's memory), hands the write to `BackgroundSaver`, and goes on training; a thread
of its own serializes the state and writes it under the same commit protocol as a synchronous save
(every file, then the marker), or waits while the writer process does (`trnflow.workload.writer`).
At most one write is in flight: the next save, the run's last one and every stop wait for it
first. A rank killed while a write is in flight leaves a folder without its marker, which no run
ever reads (`trnflow.workload.checkpoint`): the retry resumes from the newest committed checkpoint,
exactly as after any other fault.

The thread writes no log line and beats no watchdog: the loop says when a write committed
(`finished`), so a stalled loop is still taken for one while a write goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Saved:
    """One checkpoint, once committed: where, and what it cost the loop and the thread."""

    step: int
    url: str
    stalled: float
    """Seconds the training loop stopped for it: the state copied to host memory, and waiting for
    the write before it (all of the write, when synchronous)."""
    wrote: float
    """Seconds its files and marker took to write (in the background, when asynchronous)."""
    writer: str = "step"
    """Who wrote it: `step` (the loop, before going on), `thread` or `process` (`trnflow.workload.writer`)."""


def stage(tree: Any) -> Any:
    """A copy of a state dict (or any nest of dicts, lists and tensors) in host memory, which the
    training that goes on cannot change: every tensor copied, even one already in host memory."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: stage(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(stage(v) for v in tree)
    return tree


class BackgroundSaver:
    """At most one checkpoint write in flight, on a thread of its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._outcome: Saved | BaseException | None = None
        self.step: int | None = None
        """The step of the checkpoint whose write is in flight; None when none is."""

    def submit(self, step: int, write: Callable[[], str], stalled: float, writer: str = "thread") -> None:
        """Start `write` (which commits the checkpoint of `step` and returns its URL) in the
        background; `stalled`: the seconds the loop stopped for it; `writer`: `process` when `write`
        only waits for the writer process to do it. The write before it must have been waited for."""
        assert self._thread is None, "one checkpoint write in flight at a time: wait() for it first"

        def work() -> None:
            began = time.perf_counter()
            try:
                url = write()
            except BaseException as exc:  # raised in the loop, by `wait`
                self._outcome = exc
            else:
                self._outcome = Saved(step, url, stalled, time.perf_counter() - began, writer)

        self._thread = threading.Thread(target=work, name=f"checkpoint-step-{step}", daemon=True)
        self.step = step
        self._thread.start()

    def wait(self, timeout: float | None = None) -> Saved | None:
        """Wait for the write in flight to end: what it committed (None when none was in flight).
        Its error, if it failed, is raised here. With `timeout`, None when it has not ended by then
        (it is left to go on: after a failure, a write whose peers are gone need not hold the rank)."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        outcome, self._thread, self._outcome, self.step = self._outcome, None, None, None
        if isinstance(outcome, BaseException):
            raise outcome
        assert outcome is not None
        return outcome

    def finished(self) -> Saved | None:
        """The write in flight, once it has ended (its error raised), without waiting: None while it
        goes on, or when none was in flight."""
        if self._thread is not None and not self._thread.is_alive():
            return self.wait()
        return None
