"""How training writes its checkpoints: at a step boundary, in the background or in step, whole
(rank 0) or in shards (every rank), committed with a marker once every file is whole; the last one
with the whole weights and the recipe's export.

`Checkpointing` is the training loop's part that does it (`Trainer` is one); it reads the trainer's
model, optimizer, sampler, curve and lineage as they are at the step, and its `saver` runs a write
in the background, one at a time."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from trnflow.lifecycle.cards import CARD, README, ExportCard, render
from trnflow.records import (
    ADAPTER_FOLDER,
    EXPORT_MARKER,
    CheckpointMeta,
    DataRead,
    ExportedFile,
    ExportMarker,
    TrainTime,
    dump,
)
from trnflow.workload import watchdog
from trnflow.workload.checkpoint import RunCheckpoints, load_model_weights, step_name, trained_state
from trnflow.workload.context import barrier, gather_objects
from trnflow.workload.saver import Saved, stage
from trnflow.workload.sharding import shard_state, whole_model, write_shards
from trnflow.workload.writer import CheckpointWriter, Request, in_process

PACED_SHARE = 0.5
"""The share of the time to the next checkpoint a write in the background is spread over (`writer.Pace`):
done by half-way, it is seldom still writing when the next is due."""


def rng_state(sr_gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "sr": sr_gen.get_state()}


class MetaLater:
    """The meta of a checkpoint whose files are written before it is known: the run's last, written
    while the holdout evaluates its weights, the evaluation being part of the meta. `make` builds it
    on the loop's thread (`ready`); the write's thread waits for it (`take`) before it commits."""

    def __init__(self, make: Callable[[], CheckpointMeta]):
        self._make, self._meta = make, Future[CheckpointMeta]()
        self.waited = 0.0
        """Seconds the write waited for it (not writing)."""

    def ready(self) -> None:
        self._meta.set_result(self._make())

    def abandon(self) -> None:
        """The loop failed before the meta was known: the write ends without committing (`take` raises)."""
        self._meta.cancel()

    def take(self) -> CheckpointMeta:
        began = time.perf_counter()
        try:
            return self._meta.result()
        finally:
            self.waited = time.perf_counter() - began


class Checkpointing:
    """The checkpoint writes of a training run (mixed into `Trainer`, whose state they save)."""

    ctx: Any
    spec: Any
    saver: Any
    writer: CheckpointWriter | None
    checkpoint_url: str | None
    time: TrainTime
    data_read: DataRead
    beside: tuple[float, float]
    alone: Iterable[float]
    meta_later: MetaLater | None = None
    """The meta rank 0's write in flight waits for (`_checkpoint_beside_evaluation`), if any."""

    def _checkpoint(self, done: int, last: bool = False) -> None:
        """Save the checkpoint of step `done`: in the background (`train.checkpoint_async`), unless it is the
        run's `last` one, which is committed before this returns, as every stop's is."""
        began = time.perf_counter()
        with watchdog.busy(f"checkpointing step {done}"):  # rank 0 writes; the others wait for it
            self._committed(self._wait())  # the write before it
            self._write_checkpoint(done, began, background=self.spec.train.checkpoint_async and not last)

    def _checkpoint_beside_evaluation(self, done: int, evaluate: Callable[[], None]) -> None:
        """The run's last checkpoint (`train.checkpoint_async`), written while the holdout `evaluate`s
        its weights: its files in the background from the start, its meta (which holds that
        evaluation) and marker once both are done; committed on every rank before this returns."""
        began = time.perf_counter()
        with watchdog.busy(f"checkpointing step {done}"):
            self._committed(self._wait())  # the write before it
            self._write_checkpoint(done, began, background=True, meta_later=True)
        evaluate()
        waited, later = time.perf_counter(), self.meta_later
        with watchdog.busy(f"checkpointing step {done}"):
            self.meta_later = None
            if later is not None:
                later.ready()
            saved = self._wait()  # (the loop waits here only as long as the files outlast the evaluation)
            if saved is not None:  # what the loop waited for it after the evaluation is its stall too
                saved = dataclasses.replace(saved, stalled=saved.stalled + time.perf_counter() - waited,
                                            wrote=saved.wrote - (later.waited if later is not None else 0.0))
            self._committed(saved)
            barrier(self.ctx)  # committed before any rank ends

    def _abandon(self) -> None:
        """The loop failed while a write waited for its meta: that write ends uncommitted."""
        if self.meta_later is not None:
            self.meta_later.abandon()
            self.meta_later = None

    def _prepare_writer(self) -> None:
        """Start the writer process for the checkpoints this attempt will write in the background,
        now that the first step has made the optimizer's state (`CheckpointWriter.prepare`)."""
        if self.writer is None:
            return
        weights, optim = trained_state(self.model), self.optimizer.state_dict()
        if in_process(self.spec.train.checkpoint_writer, weights, optim):
            self.writer.prepare(weights, optim)

    def _checkpointed(self, done: int, saved: bool) -> None:
        """Before a stop: the checkpoint of step `done` committed, whether it was `saved` at this
        step already (in the background) or not; no rank stops before it is (the ranks that wrote
        nothing wait for rank 0, whose failure to write ends them too)."""
        if saved:
            self._settle()
            barrier(self.ctx)
        else:
            self._checkpoint(done, last=True)

    def _settle(self) -> None:
        """Wait for the checkpoint write in flight, if any, to commit (before an injected fault strikes)."""
        if self.saver.step is not None:
            with watchdog.busy(f"checkpointing step {self.saver.step}"):
                self._committed(self._wait())

    def _wait(self, timeout: float | None = None) -> Saved | None:
        """The write in flight, if any, once done: its writer no longer paced (`CheckpointWriter.hurry`)."""
        if self.writer is not None:
            self.writer.hurry()
        return self.saver.wait(timeout)

    def _write_seconds(self, done: int) -> float | None:
        """How long the write in the background of step `done`'s checkpoint may take (`writer.Pace`):
        a share (`PACED_SHARE`) of the steps to the next checkpoint (the run's last, when that comes
        sooner), at the median of recent steps that ran alone; None before one did."""
        if not self.alone:
            return None
        steps = min(self.spec.train.checkpoint_every, self.spec.train.steps - done)
        return PACED_SHARE * steps * statistics.median(self.alone)

    def _committed(self, saved: Saved | None) -> None:
        slowed = self._count_beside() if saved is not None else 0.0
        if saved is not None and self.ctx.is_main:
            self.checkpoint_url = saved.url
            self.time.stall_seconds += saved.stalled
            self.ctx.log("checkpoint", step=saved.step, url=saved.url, stalled_s=round(saved.stalled, 4),
                         slowed_s=round(slowed, 4), wrote_s=round(saved.wrote, 4), writer=saved.writer)

    def _count_beside(self) -> float:
        """Count the steps that a write in the background shared the host with (`Trainer._count`
        gathers them in `beside`), once it has ended: together, at most as many means of recent
        steps that ran alone are training; what they took beyond is the checkpoint's
        (`stall_seconds`), and returned. Taken together, a step slower by chance is offset by one
        faster by chance, as it would be without the write. The mean, not the median: step times
        lean to the slow side (a step here and there held up by the host), so as many medians would
        charge the checkpoint with that ordinary lean (measured here: a mean step 1.4% over the median
        one, about 5 s of a 300-step run's steps beside writes)."""
        took, usual = self.beside
        extra = max(0.0, took - usual)
        self.time.steps_seconds += took - extra
        self.time.stall_seconds += extra
        self.beside = (0.0, 0.0)
        return extra

    def _write_checkpoint(self, done: int, began: float, background: bool, meta_later: bool = False) -> None:
        """Write the checkpoint of step `done` (the loop stopped for it at `began`), in the `background`
        or before this returns; with `meta_later` (in the background), its meta is left for
        `MetaLater.ready` to give, and the write commits only then."""
        ctx, spec = self.ctx, self.spec
        rng = gather_objects(ctx, rng_state(self.sr_gen))
        last = done == spec.train.steps
        weights: dict | None = None
        optim: dict | None = None
        shards: Callable[[], dict[str, dict]] | None = None
        by_writer = False  # saved by the writer process (`writer`), not by this one
        checkpoints = self.faults.checkpoint_store(self.start.checkpoints, writer=True)
        if self.sharded:  # every rank stores its own shard; the last checkpoint holds the whole weights too
            shards = self._shards(done, background, checkpoints)
            weights = whole_model(self.model) if last else None  # gathered on rank 0 (every rank takes part)
        elif ctx.is_main:
            # checkpoints hold CPU copies, whatever the device; one written in the background, copies
            # that the training going on meanwhile cannot change (in memory its writer process maps)
            weights, optim = trained_state(self.model), self.optimizer.state_dict()
        export = self._export(done, weights) if last and weights is not None and ctx.is_main else None
        if not self.sharded and ctx.is_main:
            by_writer = (background and self.writer is not None and checkpoints is self.start.checkpoints
                         and in_process(spec.train.checkpoint_writer, weights, optim))  # (a torn one: on the thread)
            if by_writer:
                weights, optim = self.writer.stage(weights, optim)
            else:
                host = stage if background else self.device.to_host
                weights, optim = host(weights), host(optim)
        commit = None
        if ctx.is_main:
            meta: CheckpointMeta | MetaLater = self._meta(done, export) if not meta_later else MetaLater(
                lambda: self._meta(done, export))
            self.meta_later = meta if isinstance(meta, MetaLater) else None
            commit = self._commit(done, weights, optim, rng, checkpoints, meta, by_writer)

        def write() -> str:
            listed = shards() if shards is not None else None
            return commit(listed) if commit is not None else ""

        writes = ctx.is_main or self.sharded  # a ddp rank other than 0 writes nothing
        if background and writes:
            self.saver.submit(done, write, time.perf_counter() - began, writer="process" if by_writer else "thread")
            if checkpoints is not self.start.checkpoints and not meta_later:
                self._settle()  # an injected tear: this rank dies in its write, at this step (or, its meta
                # later, in the files written beside the evaluation)
        elif not background:
            wrote = time.perf_counter()
            url = write()
            self._committed(Saved(done, url, time.perf_counter() - began, time.perf_counter() - wrote))
        # The ranks leave the step boundary together. A synchronous write is whole by then: a fault on
        # another rank in the next step would otherwise take rank 0 down mid-save and lose the
        # interval. One in the background can be lost so: the retry resumes from the one before.
        barrier(ctx)
        if not (background and writes):  # a rank writing in the background is torn as it writes, if at all
            self.faults.checkpoint_written()

    def _meta(self, done: int, export: str | None) -> CheckpointMeta:
        """The meta of the checkpoint of step `done`, as the run stands now (`export`: the URL of
        the last one's export)."""
        spec = self.spec
        return CheckpointMeta(
            run_id=self.run_id, step=done, **self.lineage, global_step=self.lineage["base_step"] + done,
            spec_digest=spec.digest(), precision=spec.compute.precision, world_size=self.ctx.world_size,
            loss=self.last_loss if math.isfinite(self.last_loss) else None, sampler=self.sampler.position(done),
            data=self.data_read, watermark=self.start.watermark, metrics=list(self.metrics),
            evaluations=list(self.evaluations), holdout_sha256=self.holdout.digest, recipe=self.recipe.describe(),
            torch=torch.__version__, export=export, base=self.recipe.base(),
            parallelism="fsdp" if self.programs.fsdp else "ddp", tp=self.ctx.tp, time=self.time.model_copy())

    def _commit(self, done: int, weights: Any, optim: Any, rng: list[dict], checkpoints: RunCheckpoints,
                meta: CheckpointMeta | MetaLater, by_writer: bool = False) -> Callable[[dict[str, dict] | None], str]:
        """Rank 0's part of the checkpoint of step `done`: what writes its files, `meta` (once it is
        given, when later) and marker to `checkpoints` (given the shards' checksums, when sharded) and
        returns its URL; `by_writer`: has the writer process write the files, `weights` and `optim`
        being staged there."""
        featurizer, keep = (self.recipe.featurizer_file, self.recipe.state()), self.spec.train.keep_latest

        def files(shards: dict[str, dict] | None) -> dict[str, dict]:
            if by_writer:
                return self.writer.write_files(Request(checkpoints.url, done, weights, optim, rng, featurizer, None,
                                                       keep, seconds=self._write_seconds(done)))
            return checkpoints.write_files(done, weights, optim, rng, featurizer, shards=shards)

        def commit(shards: dict[str, dict] | None) -> str:
            if isinstance(meta, CheckpointMeta) and by_writer:  # the writer commits it too
                return self.writer.save(Request(checkpoints.url, done, weights, optim, rng, featurizer, meta, keep,
                                                seconds=self._write_seconds(done)))
            listed = files(shards)  # then the meta, waited for when it comes later (abandoned: none is committed)
            return checkpoints.commit(done, listed, meta.take if isinstance(meta, MetaLater) else meta, keep, shards)

        return commit

    def _shards(self, done: int, background: bool, checkpoints: RunCheckpoints) -> Callable[[], dict[str, dict]]:
        """What writes this rank's shard of the checkpoint of step `done` (DCP) to its folder, which
        rank 0 first clears of a torn earlier attempt, and returns every shard's checksum (on every
        rank: a collective). In the background, its state is copied to host memory now, and its
        collectives go over the side group (`side`), never the step's."""
        ctx = self.ctx
        state = stage(shard_state(self.model, self.optimizer)) if background else None  # a collective
        group = self.side if background else None

        def write() -> dict[str, dict]:
            if ctx.is_main:
                self.start.checkpoints.clear(done)
            barrier(ctx, group)
            with tempfile.TemporaryDirectory(prefix="trnflow-shards-") as tmp:
                files = write_shards(state if state is not None else shard_state(self.model, self.optimizer),
                                     Path(tmp), group)
            return {name: digest for listed in gather_objects(ctx, checkpoints.write_shards(done, files), group)
                    for name, digest in listed.items()}

        return write

    def _card(self, done: int, folder: Path) -> None:
        """The export's card (`card.json`) and its README.md, the gate not yet judged; a LoRA
        export's adapter folder gets the same card, in place of PEFT's empty template."""
        pretrained = self.recipe.describe().params.get("pretrained")
        card = ExportCard(model=self.spec.name, run_id=self.run_id, step=done, recipe=self.recipe.describe(),
                          global_step=self.lineage["base_step"] + done, precision=self.spec.compute.precision,
                          data=self.data_read, pretrained=pretrained if isinstance(pretrained, str) else None,
                          base=self.recipe.base())
        (folder / CARD).write_text(card.model_dump_json(indent=2))
        (folder / README).write_text(render(card))
        if (folder / ADAPTER_FOLDER).is_dir():
            (folder / ADAPTER_FOLDER / README).write_text(render(card, adapter=True))

    def _export(self, done: int, weights: dict[str, torch.Tensor]) -> str | None:
        """The trained model in its own library's format, under `<run>/export/step-NNNNNN/` (the
        marker EXPORTED last, with each file's checksum), for recipes that export; its URL."""
        with tempfile.TemporaryDirectory(prefix="trnflow-export-") as tmp:
            with torch.random.fork_rng(devices=[]):  # building it must not move the run's random streams
                model = self.recipe.build_model()
            load_model_weights(model, weights, "the run's last weights", without_frozen=True)
            if not self.recipe.export(model, Path(tmp)):
                return None
            self._card(done, Path(tmp))
            folder = f"export/{step_name(done)}"
            store = self.start.checkpoints.store
            with contextlib.suppress(Exception):  # an earlier attempt's files: overwritten below if they stay
                store.delete_prefix(f"{folder}/")
            files = {}
            for path in sorted(Path(tmp).rglob("*")):
                if path.is_file():
                    name = path.relative_to(tmp).as_posix()
                    data = path.read_bytes()
                    store.write(f"{folder}/{name}", data)
                    files[name] = ExportedFile(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            store.write(f"{folder}/{EXPORT_MARKER}", dump(ExportMarker(recipe=self.recipe.describe(), files=files,
                                                                       base=self.recipe.base())))
        url = f"{self.start.checkpoints.url}/{folder}"
        self.ctx.log("export", step=done, url=url, files=len(files))
        return url
