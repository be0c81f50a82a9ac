"""The training phase: DDP over the device's process group, one rank per NeuronCore, resumable from its own checkpoints.

A run's checkpoints live under `<checkpoint_url>/<run_id>/`. A retried attempt of the same run
finds its newest committed checkpoint there and continues from that exact step and sample; a new
run starts from `train.init_from` (or from scratch). See `start` for which data a run reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import torch

from trnflow.errors import FatalError, Interrupted, OverBudget, SpotInterruption
from trnflow.fsutil import atomic_write_json
from trnflow.lifecycle.gate import SERIES, write_series
from trnflow.measures import DeviceMemory
from trnflow.records import CurvePoint, DataRead, MetricPoint, TrainTime
from trnflow.results import SlowRank, SlowRanks, TrainResult
from trnflow.specs.instances import instance_cost
from trnflow.storage.datafiles import data_files, partitions, training_window
from trnflow.workload import watchdog
from trnflow.workload.checkpoint import (
    Checkpoint,
    check_weights,
    load_model_weights,
    on_base,
    trainable,
    trained_state,
    weights_digest,
)
from trnflow.workload.checkpointing import Checkpointing
from trnflow.workload.collectives import all_true
from trnflow.workload.context import WorkerContext, barrier, gather_objects
from trnflow.workload.data import iter_labelled
from trnflow.workload.divergence import Divergence
from trnflow.workload.evaluate import Holdout
from trnflow.workload.features import featurize, host_memory
from trnflow.workload.memory import estimate, saved_activation_peak, tensor_bytes
from trnflow.workload.pace import StepPace
from trnflow.workload.programs import build_model, for_run, spread
from trnflow.workload.recipes import Recipe, for_job
from trnflow.workload.reclaim import ReclaimNotice
from trnflow.workload.recompute import recompute
from trnflow.workload.sampler import StepSampler
from trnflow.workload.saver import BackgroundSaver
from trnflow.workload.sharding import load_optimizer, load_shards, load_whole, whole_model
from trnflow.workload.start import Start, find_start
from trnflow.workload.writer import CheckpointWriter

WRITE_AFTER_FAILURE_SECONDS = 25.0
"""How long a rank whose training failed waits for its checkpoint write in flight before it ends: a
sharded write whose peers are gone may never end, and the launcher kills a rank 30 s after a peer
failed (torchrun's grace)."""


def _featurizer(ctx: WorkerContext, recipe: Recipe, start: Start, rows: Callable[[], Iterator[pa.Table]]) -> None:
    """The parent's featurizer, or one fitted on this run's rows (`rows()` streams them). Every rank
    fits it, as every rank featurizes every row: the same rows give the same state, and no rank
    waits for another's fit on a large set (a wait longer than the collective timeout would look
    like a hung rank). Should a recipe's fit differ between processes, rank 0's is everyone's."""
    source = start.source
    if source is not None and source.featurizer is not None:
        recipe.load(source.featurizer, source.url)
        return
    if source is not None:
        ctx.log("warning", message=f"{source.url} has no {recipe.featurizer_file} beside it, so a new featurizer is "
                "fitted; put the one the weights were trained with beside the file to keep the features the same")
    recipe.fit_batches(rows())
    state = recipe.state()
    if len(set(gather_objects(ctx, hashlib.sha256(state).hexdigest()))) > 1:
        shared = gather_objects(ctx, state if ctx.is_main else None)[0]
        recipe.load(shared, "rank 0's fitted featurizer")


def _skipped(ctx: WorkerContext, start: Start) -> TrainResult:
    mark = start.watermark or "none"
    reason = f"no training partitions after the watermark {mark} of {start.init.url if start.init else 'scratch'}"
    ctx.log("skipped", reason=reason)
    return TrainResult(skipped=True, reason=reason, watermark=start.watermark,
                       checkpoint=start.init.url if start.init else None, steps_trained=0)


CLEAN_STEPS = 20
"""The recent steps with no checkpoint write beside them whose mean a step beside one counts at."""


class Trainer(Checkpointing):
    """One training run on this rank: the model, its optimizer and data, resumed or started afresh.

    `run` is the loop; the methods it calls say what each step, evaluation and checkpoint does.
    The device decides precision and stochastic rounding; its fault hooks are where injected
    faults strike (a step, its result, a checkpoint)."""

    def __init__(self, ctx: WorkerContext, run_id: str, start: Start, recipe: Recipe, budget_usd: float | None = None):
        self.began = time.monotonic()  # the clock of train.max_minutes and of the budget
        self.ctx, self.run_id, self.start, self.recipe = ctx, run_id, start, recipe
        self.budget_usd = budget_usd
        """What this job may cost (the orchestrator's reckoning, `--budget-usd`); None: no limit."""
        self.spec, self.device, self.faults = ctx.spec, ctx.device, ctx.faults
        tcfg = self.spec.train
        data = self.spec.data

        def rows() -> Iterator[pa.Table]:  # streamed: a training set of any size is never read whole
            return iter_labelled(start.files, data, recipe.columns(), recipe.num_classes, data.train)

        _featurizer(ctx, recipe, start, rows)
        train = featurize(rows(), recipe, label_field=data.label_field, pack=data.packing)
        assert train.labels is not None
        if train.packing is not None:  # the windows are what the steps sample
            ctx.log("packing", rows=train.packing.rows, windows=train.packing.windows,
                    fill=round(train.packing.fill, 4), message=str(train.packing))
        self.tokens, self.labels = train.features, train.labels  # packed: a window a row
        self.packing = train.packing
        read = train.packing.rows if train.packing is not None else len(self.labels)
        self.model = build_model(recipe, tcfg.seed).to(self.device.torch_device)  # before its optimizer holds it
        recompute(recipe.blocks(self.model), tcfg.activation_checkpointing, recipe.saved_ops)
        fsdp = self.spec.layout.strategy == "fsdp"
        # Split (tp) and sharded (fsdp) weights are DTensors: the optimizer is built on this rank's parts
        self.mesh = spread(self.spec, recipe, self.model, self.device, fsdp)
        self.sharded = fsdp or ctx.tp > 1  # its state is saved in shards, and gathered whole
        self.optimizer = recipe.optimizer(trainable(self.model), tcfg)  # a frozen base has no optimizer state
        self.rounding = self.device.rounding(self.spec.compute.precision)
        # Replicas must round identically, so the rounding stream is seeded the same on every rank.
        self.sr_seed = int(os.environ.get("NEURON_RT_STOCHASTIC_ROUNDING_SEED", "0")) + tcfg.seed
        self.sr_gen = torch.Generator().manual_seed(self.sr_seed)
        self.sampler = StepSampler(len(self.labels), tcfg.global_batch_size, ctx.replica, ctx.replicas, tcfg.seed,
                                   drop_last=tcfg.drop_last, packed=train.packing is not None)
        self.resumed_weights: str | None = None
        self.first, self.metrics = self._resume_or_init()
        self.lineage = start.lineage()
        self.data_read = DataRead(files=[f.name for f in start.files], partitions=partitions(start.files),
                                  watermark=start.watermark, rows=read)
        ctx.log("data", files=len(start.files), rows=read, partitions=self.data_read.partitions,
                watermark=start.watermark, recipe=recipe.key)
        if budget_usd is not None:  # the job's own budget, as the orchestrator reckoned it
            ctx.log("budget", usd=round(budget_usd, 4), price_per_hour=self.spec.compute.hourly_price,
                    nodes=self.spec.compute.nodes)
        self.programs = for_run(ctx, recipe, self.model, ddp=ctx.replicas > 1 and not fsdp, sharded=self.sharded,
                                mesh=self.mesh, fsdp=fsdp)
        self.holdout = Holdout(ctx, recipe)
        resumed = start.resumed.meta if start.resumed else None
        self.evaluations: list[MetricPoint] = list(resumed.evaluations) if resumed else []
        self.last_loss = resumed.loss if resumed and resumed.loss is not None else float("nan")
        self.time = resumed.time.model_copy() if resumed else TrainTime()  # along the attempts before, too
        self.series_url: str | None = None
        self.final_eval_seconds = 0.0
        self.checkpoint_url: str | None = None
        self.saver = BackgroundSaver()  # train.checkpoint_async: the last checkpoint and a stop's aside
        self.writer = CheckpointWriter() if tcfg.checkpoint_async and ctx.is_main and not self.sharded else None
        """The process rank 0 writes whole checkpoints in, in the background (the shards are DCP's, on the thread)."""
        self.side = self.device.side_group() if tcfg.checkpoint_async and self.sharded else None
        """The process group of the shards' writes in the background (every rank makes it, alike)."""
        self.memory: dict = {}
        self.step_times: list[float] = []  # the first step pays for loading (or compiling) the graph
        self.alone: deque[float] = deque(maxlen=CLEAN_STEPS)  # recent steps with no checkpoint write beside them
        self.beside = (0.0, 0.0)  # the steps beside the write in flight: their seconds, and as many means of `alone`
        self.pace = StepPace(ctx, self.spec.compute.hang_step_factor, self.spec.compute.hang_floor_seconds,
                             self.spec.compute.slow_rank_factor)
        self.divergence = Divergence(ctx, start.checkpoints.store)
        self._window = (time.perf_counter(), 0, 0.0)  # since the last logged point: start, steps, summed loss
        self.late_said = False
        self.after_first: float | None = None  # when this attempt's first step ended: its steady clock

    def run(self) -> TrainResult:
        began = time.perf_counter()
        notice = ReclaimNotice(self.ctx, spot=self.spec.compute.spot)
        try:
            first: int | None = self.first
            while first is not None:  # again from the step a rollback went back to
                first = self._steps(first, notice)
        finally:
            self.pace.close()
            self._abandon()  # a write waiting for the meta of an evaluation that failed
            with contextlib.suppress(Exception):  # a write in flight as the loop failed: let it commit, if it can
                self._committed(self._wait(timeout=WRITE_AFTER_FAILURE_SECONDS))
            if self.writer is not None and self.saver.step is None:  # (one still writing ends with this process)
                self.writer.close()
            notice.close()  # after the loop (and that write) a SIGTERM ends the rank at once again
        return self._result(time.perf_counter() - began)

    def _steps(self, first: int, notice: ReclaimNotice) -> int | None:
        """The steps after `first`; after a divergence rolled back, the step to go on from, else None."""
        tcfg = self.spec.train
        for step, idx in self.sampler.batches(first, tcfg.steps):
            done = step + 1
            self.faults.begin_step(done, self._first_time, self._settle)
            self.pace.begun(done, rows=len(idx))
            if done in self.divergence.skips:  # its batch is not trained on (train.skip_steps, or a rollback)
                self.ctx.log("skip", step=done)
            else:
                self.last_loss = self._step(idx, done)
                if self.divergence.rollback and (why := self.divergence.why(self.last_loss)):
                    return self._roll_back(done, idx, why)
                watchdog.beat(f"train step {done}")
                self.pace.ended(self.step_times[-1], self.programs.own_seconds, rows=len(idx))
                self._count(beside_write=self.saver.step is not None)
                if len(self.step_times) == 1:
                    self._prepare_writer()
            self._committed(self.saver.finished())
            over = None
            if (done % tcfg.log_every == 0 or done == tcfg.steps) and self._window[1]:
                left = self._log_point(done)
                over = self._over_budget(done, left)
            saved = done % tcfg.checkpoint_every == 0 or done == tcfg.steps
            if done == tcfg.steps and tcfg.checkpoint_async:  # the last checkpoint's files beside its evaluation
                self._checkpoint_beside_evaluation(done, functools.partial(self._evaluate_at, done))
            else:
                self._evaluate_at(done)
                if saved:
                    self._checkpoint(done, last=done == tcfg.steps)
            if over is not None:
                self._checkpointed(done, saved)
                raise OverBudget(f"{over}: training stopped after step {done} and checkpointed it; rerun with the "
                                 f"same run id and a higher budget to resume from step {done}")
            if done < tcfg.steps and notice.agreed():
                self._checkpointed(done, saved)
                if notice.spot:
                    raise SpotInterruption(f"the instance is being reclaimed (spot): training stopped after step "
                                           f"{done} and checkpointed it; the retry resumes from step {done}")
                raise Interrupted(f"the job was asked to stop (SIGTERM): training stopped after step {done} and "
                                  f"checkpointed it; a rerun with the same run id resumes from step {done}")
        return None

    def _count(self, beside_write: bool) -> None:
        """Count the step just trained as work the weights hold: an attempt's first step (which loads
        or compiles its graphs) at its second's time, once that is known. One a checkpoint write in
        the background shared the host with is counted once the write has ended (`_count_beside`)."""
        times = self.step_times
        if len(times) < 2:
            return
        steps = 2 if len(times) == 2 else 1
        took = times[-1] * steps
        if beside_write and self.alone:
            self.beside = (self.beside[0] + took, self.beside[1] + statistics.fmean(self.alone) * steps)
            return
        self._count_beside()
        self.time.steps_seconds += took
        if not beside_write:
            self.alone.append(times[-1])

    def _roll_back(self, done: int, idx: torch.Tensor, why: str) -> int:
        """Go back to the newest checkpoint before step `done`, which diverged (`why`), and skip that
        step's batch from now on (train.on_divergence: rollback); the step to go on from."""
        began = time.perf_counter()
        with watchdog.busy(f"rolling back from step {done}"):
            self.divergence.allowed(done, why)
            self._settle()  # a write in flight is of a step before this one: committed, it is the newest
            barrier(self.ctx)  # every rank's write, rank 0's marker last, is committed before any rank looks
            back = self.start.checkpoints.latest(on_skip=lambda url, r: self.ctx.log("checkpoint_skipped", url=url,
                                                                                    reason=r))
            found = back.meta.step if back is not None and back.meta is not None else None
            if len(set(gather_objects(self.ctx, found))) > 1:
                raise FatalError(f"rolling back from step {done}, the ranks found different newest checkpoints in "
                                 f"{self.start.checkpoints.url}; resume the run from its checkpoints instead")
            if back is None or back.meta is None:
                raise FatalError(f"training diverged at step {done} ({why}) before its first checkpoint, so there "
                                 "is nothing to roll back to; checkpoint sooner (train.checkpoint_every) or lower "
                                 "train.lr")
            samples = sorted({int(i) for part in gather_objects(self.ctx, idx.tolist()) for i in part})
            entry = self.divergence.record(done, why, back.meta.step, samples)
            barrier(self.ctx)  # rollbacks.json is written before any rank goes on
            kept, self.resumed_weights = self.resumed_weights, None
            first = self._restore(back)
            assert first < done, (first, done)
            self.resumed_weights = kept  # the result's: what the attempt began with
            self.metrics, self.evaluations = list(back.meta.metrics), list(back.meta.evaluations)
            self.last_loss = back.meta.loss if back.meta.loss is not None else float("nan")
            self._window = (time.perf_counter(), 0, 0.0)
            self.divergence.losses.clear()  # the replayed steps' losses are heard again
            self.pace.rewound()
            was, then = self.time, back.meta.time  # the work since that checkpoint, and this step's, is undone
            undone = ((was.steps_seconds - then.steps_seconds) + (was.stall_seconds - then.stall_seconds)
                      + (was.eval_seconds - then.eval_seconds))
            self.time = then.model_copy(update={"slow_seconds": was.slow_seconds, "rollback_seconds": (
                was.rollback_seconds + undone + self.step_times[-1] + time.perf_counter() - began)})
            self.ctx.log("rollback", step=done, to=first, reason=why, samples=len(samples), message=str(entry))
            barrier(self.ctx)  # every rank restored (a sharded one reads its shards) before any goes on
        return first

    def _first_time(self, fault: Any) -> bool:
        """Record a fault as fired, once per run (a retry resumes past it)."""
        return self.start.checkpoints.store.create(f"faults/{fault.label}", self.faults.marker())

    def _resume_or_init(self) -> tuple[int, list[CurvePoint]]:
        """The step to start from and the curve so far: a retry resumes its own checkpoint exactly."""
        ctx, tcfg, start, resumed = self.ctx, self.spec.train, self.start, self.start.resumed
        if resumed is not None:
            assert resumed.meta is not None  # a run's own checkpoints always have their meta.json
            return self._restore(resumed), list(resumed.meta.metrics)
        adapters = start.init is not None and on_base(start.init, self.recipe.base())
        if start.init is not None and self.sharded:
            load_whole(self.model, None, check_weights(self.model, start.init.model, start.init.url, adapters), None)
        elif start.init is not None:
            load_model_weights(self.model, start.init.model, start.init.url, adapters)
        if start.init is not None:
            ctx.log("init", checkpoint=start.init.url, watermark=start.init.watermark)
        # Each replica its own dropout stream; the cores of a tensor-parallel group share theirs, so
        # that dropout on what they hold whole drops the same values on each.
        torch.manual_seed(tcfg.seed + 1000 * ctx.replica)
        if self.rounding:  # put the starting weights on the bf16 grid; resumed ones already are
            self.device.round_state(self.model, None, self.rounding, self.sr_gen)
        return 0, []

    def _restore(self, resumed: Checkpoint) -> int:
        """Load one of the run's own checkpoints exactly (weights, optimizer, random streams); its step."""
        ctx, tcfg = self.ctx, self.spec.train
        adapters = on_base(resumed, self.recipe.base())
        if self.sharded and resumed.sharded:  # each rank reads its part of the shards, at any world size
            try:
                load_shards(self.model, self.optimizer, resumed.shards or {})
            except ValueError as exc:
                raise FatalError(f"{resumed.url}: {exc}; the checkpoint is damaged: delete it to resume from "
                                 "the one before") from None
            resumed.shards = None  # read: each rank keeps its part, not every shard's bytes
            weights = whole_model(self.model)  # on rank 0 alone, whose result says what was loaded
            self.resumed_weights = weights_digest(weights) if ctx.is_main else None
        elif self.sharded:  # a ddp run's checkpoint holds them whole: each rank keeps its shard
            weights = check_weights(self.model, resumed.model, resumed.url, adapters)
            self.resumed_weights = weights_digest(weights)  # what is loaded, never gathered whole on a core
            load_whole(self.model, self.optimizer, weights, resumed.optim)  # (which shards `weights` in place)
        else:
            load_model_weights(self.model, resumed.model, resumed.url, adapters)
            load_optimizer(self.model, self.optimizer, resumed.optim)
            self.resumed_weights = weights_digest(self.device.to_host(trained_state(self.model)))
        assert resumed.meta is not None
        first = self.sampler.restore(resumed.meta.sampler)
        if resumed.rng and len(resumed.rng) == ctx.world_size and resumed.meta.tp == ctx.tp:
            torch.set_rng_state(resumed.rng[ctx.rank]["torch"])
            self.sr_gen.set_state(resumed.rng[ctx.rank]["sr"])
        else:  # a different world size: per-rank streams cannot carry over, so derive new ones
            torch.manual_seed(tcfg.seed + 1000 * ctx.replica + first)
            self.sr_gen.manual_seed(self.sr_seed + first)
        ctx.log("resume", step=first, checkpoint=resumed.url, saved_by_ranks=len(resumed.rng or []),
                ranks=ctx.world_size)
        return first

    def _step(self, idx: torch.Tensor, done: int) -> float:
        """Forward, backward and optimizer step on one global batch; the loss, which must be finite."""
        began = time.perf_counter()
        # Shapes are static, so the first step's saved activations are every step's.
        probe = saved_activation_peak() if not self.memory else contextlib.nullcontext({})
        with probe as saved:
            loss = self.programs.train_step(self.tokens[idx], self.labels[idx], self.optimizer,
                                            lambda loss: self._finite(self.faults.result(loss), done),
                                            worked=self.pace.reached)
        if not self.memory:
            self.memory = _memory_held(self.model, self.optimizer, saved.get("peak", 0))
        if self.rounding:
            self.device.round_state(self.model, self.optimizer, self.rounding, self.sr_gen)
        self.step_times.append(time.perf_counter() - began)
        if self.after_first is None:
            self.after_first = time.perf_counter()
        value = loss.item()
        start, steps, summed = self._window
        self._window = (start, steps + 1, summed + value)
        return value

    def _finite(self, loss: torch.Tensor, done: int) -> torch.Tensor:
        """The step's loss, refused when it is not finite (train.on_divergence: stop): the run stops
        before it saves anything more. With rollback, the loop heals it."""
        value = loss.item()
        if not math.isfinite(value) and not self.divergence.rollback:
            raise FatalError(
                f"loss is {value} at step {done} on rank {self.ctx.rank}; the run diverged. "
                "Lower train.lr or use fp32; retrying would diverge again"
            )
        return loss

    def _log_point(self, done: int) -> float:
        """A point of the training curve: the mean loss since the last point (one batch's is too noisy),
        logged with the time the steps left would take (`_left`); that time. Once training would end
        after train.max_minutes, a `late` event says so (once)."""
        tcfg = self.spec.train
        start, steps, summed = self._window
        elapsed = time.perf_counter() - start
        point = CurvePoint(step=done, global_step=self.lineage["base_step"] + done, loss=round(summed / steps, 7),
                           samples_per_s=round(steps * tcfg.global_batch_size / elapsed, 1),
                           graphs=len(self.programs.compiler.seen))
        self.metrics.append(point)
        left = self._left(done)
        self.ctx.log("train", steps=tcfg.steps, **point.model_dump(), eta_s=round(left, 1))
        found = self.pace.compare(done)  # every rank takes part; rank 0 says it
        if found:  # every rank waited for the slowest, a step at a time
            worst = max(found, key=lambda s: s.ratio)
            self.time.slow_seconds += (worst.own_seconds - worst.peers_seconds) * self.pace.window_steps
        for slow in found:
            if self.ctx.is_main:
                self.ctx.log("slow_rank", step=done, slow_rank=slow.rank, core=slow.core, host=slow.host,
                             ratio=slow.ratio, own_s=slow.own_seconds, peers_s=slow.peers_seconds, message=str(slow))
        if found and self.ctx.is_main:  # for the container, should the attempt fail: suspect hosts
            atomic_write_json(self.ctx.output_dir / SlowRanks.FILE,
                              SlowRanks(slow=self._slow_ranks()).model_dump(mode="json"))
        self._window = (time.perf_counter(), 0, 0.0)
        ends = time.monotonic() - self.began + left
        steady = len(self.step_times) > 1  # a step after the first was timed: the rate says something
        if steady and tcfg.max_minutes is not None and ends > tcfg.max_minutes * 60 and not self.late_said:
            self.late_said = True
            self.ctx.log("late", step=done, deadline_minutes=tcfg.max_minutes, forecast_minutes=round(ends / 60, 2),
                         message=f"training is forecast to end {ends / 60:.1f} min after its start, after its "
                         f"deadline of {tcfg.max_minutes:g} min (train.max_minutes), at the rate of its steps so far")
        return left

    def _slow_ranks(self) -> list[SlowRank]:
        return sorted(self.pace.slow.values(), key=lambda s: s.rank)

    def _left(self, done: int) -> float:
        """Seconds the steps after `done` should take: at this attempt's wall time a step since its
        first step ended (the checkpoints and evaluations among them included), not counting the
        first, which loads or compiles the graph; with only the first done, at its time."""
        steady = len(self.step_times) - 1  # the steps this attempt ran (a rollback's replays too)
        if steady <= 0 or self.after_first is None:
            per_step = self.step_times[0] if self.step_times else 0.0
        else:
            per_step = (time.perf_counter() - self.after_first) / steady
        return (self.spec.train.steps - done) * per_step

    def _over_budget(self, done: int, left: float) -> str | None:
        """Why training stops here: the cost spent since it started plus the forecast for the `left`
        seconds of steps it has left would exceed its budget (agreed by every rank, so all stop
        after the same step); None to go on."""
        tcfg, compute, budget = self.spec.train, self.spec.compute, self.budget_usd
        if budget is None or compute.hourly_price is None or done >= tcfg.steps or len(self.step_times) < 2:
            return None  # (nothing to check yet after only the first step, which loads or compiles the graph)
        spent = instance_cost(compute.hourly_price, compute.nodes, time.monotonic() - self.began)
        more = instance_cost(compute.hourly_price, compute.nodes, left)
        over = spent + more > budget
        if self.ctx.world_size > 1:  # a rank that never arrives is named, as in any collective step
            over = not self.ctx.collective("agreeing on the budget", lambda: all_true(not over))
        if not over:
            return None
        return (f"training would cost ${spent + more:.4f} (${spent:.4f} spent, ${more:.4f} more for the "
                f"{tcfg.steps - done} steps left at the rate so far), over its budget of ${budget:.4f} "
                "(train.max_cost_usd, or what compute.max_cost_usd leaves for training)")

    def _evaluate_at(self, done: int) -> None:
        """Evaluate the holdout after step `done`, if the spec says to there (every run does at its last)."""
        if self.spec.evaluates_at(done):
            with watchdog.busy(f"evaluating at step {done}"):
                self._evaluate(done)

    def _evaluate(self, done: int) -> None:
        began = time.perf_counter()
        point, correct = self.holdout.evaluate(self.programs, done, self.lineage["base_step"] + done)
        if done == self.spec.train.steps:  # the final weights' (the gate's), apart from getting them
            self.final_eval_seconds = time.perf_counter() - began
        else:
            self.time.eval_seconds += time.perf_counter() - began
        self.evaluations = [p for p in self.evaluations if p.step != done] + [point]
        if self.ctx.is_main:
            self.series_url = write_series(self.start.checkpoints.url, self.run_id, self.evaluations,
                                           self.holdout.digest, done, correct, self.holdout.directions)

    def _result(self, seconds: float) -> TrainResult:
        self._count_beside()
        tcfg, start, lineage = self.spec.train, self.start, self.lineage
        trained = tcfg.steps - self.first
        per_rank = gather_objects(self.ctx, self.memory.get("total", 0))
        checkpoint_url, series_url = self.checkpoint_url, self.series_url
        if checkpoint_url is None and start.resumed is not None:  # resumed at the last step: nothing left to do
            checkpoint_url = start.resumed.url
        if series_url is None and self.evaluations:
            series_url = f"{start.checkpoints.url}/{SERIES}"
        times = self.step_times
        return TrainResult(
            run_id=self.run_id,
            checkpoint=checkpoint_url,
            start_step=self.first,
            steps=tcfg.steps,
            steps_trained=trained,
            resumed_from=start.resumed.url if start.resumed else None,
            resumed_weights=self.resumed_weights,
            parent=lineage["parent"],
            global_step=lineage["base_step"] + tcfg.steps,
            watermark=start.watermark,
            partitions=self.data_read.partitions,
            rows=self.data_read.rows,
            packing=self.packing,
            loss=self.last_loss if math.isfinite(self.last_loss) else None,
            evaluations=self.evaluations,
            curve=self.metrics,
            series=series_url,
            holdout_sha256=self.holdout.digest,
            samples_per_s=round(trained * tcfg.global_batch_size / seconds, 1) if trained else 0.0,
            seconds=round(seconds, 3),
            first_step_seconds=round(times[0], 4) if times else 0.0,
            median_step_seconds=round(statistics.median(times[1:]), 5) if len(times) > 1 else 0.0,
            compile=self.programs.compiler.metrics(),
            recipe=self.recipe.describe(),
            device_memory=DeviceMemory(estimated_per_core=estimate(self.spec, self.recipe).total,
                                       peak_per_rank=per_rank, **self.memory),
            host_memory=host_memory(self.ctx, self.tokens),
            slow_ranks=self._slow_ranks(),
            rollbacks=self.divergence.log.rollbacks,
            time=self.time,
            time_before=start.resumed.meta.time if start.resumed and start.resumed.meta else TrainTime(),
            attempt_seconds=round(time.monotonic() - self.began, 3),
            final_eval_seconds=round(self.final_eval_seconds, 3),
        )


def _window(ctx: WorkerContext, start: Start) -> Start:
    """A new run's files and watermark, chosen from a listing that also holds what it would not
    read: a day of files it cannot read (another format, or marked ready but empty) stops the run
    with a DataError naming the day, and the watermark never passes a day that was not read (a day
    not marked ready holds back the days after it). A resumed run reads exactly the files it began on."""
    if start.resumed is not None:
        return start
    data = ctx.spec.data
    listing = data_files(data.train, data.format, data.ready_marker, every=True)
    window = training_window(listing, data.window, start.init.watermark if start.init else None, data.train,
                             data.format)
    return dataclasses.replace(start, files=window.files, watermark=window.watermark)


def run(ctx: WorkerContext, run_id: str, budget_usd: float | None = None) -> TrainResult:
    """Train the spec (`budget_usd`: what the job may cost, as the orchestrator reckoned it)."""
    recipe = for_job(ctx.spec)
    start = _window(ctx, find_start(ctx, run_id, recipe.featurizer_file))
    if not start.files:
        return _skipped(ctx, start)
    return Trainer(ctx, run_id, start, recipe, budget_usd).run()


def _memory_held(model: torch.nn.Module, optimizer: torch.optim.Optimizer, activations: int) -> dict:
    """Bytes this rank holds for the step: weights, gradients, optimizer state, saved activations."""
    params = list(model.parameters())
    held = {
        "weights": tensor_bytes(p.data for p in params),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": tensor_bytes(t for st in optimizer.state.values() for t in st.values()
                                  if isinstance(t, torch.Tensor)),
        "activations": activations,
    }
    return {**held, "total": sum(held.values())}
