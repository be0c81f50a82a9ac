"""The training phase: DDP over gloo, one rank per NeuronCore, resumable from its own checkpoints.

A run's checkpoints live under `<checkpoint_url>/<run_id>/`. A retried attempt of the same run
finds its newest committed checkpoint there and continues from that exact step and sample; a new
run starts from `train.init_from` (or from scratch). See `start` for which data a run reads.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import statistics
import time

import torch

from trnflow.emulator.faults import TearingStore
from trnflow.emulator.memory import estimate, saved_activation_peak, tensor_bytes
from trnflow.emulator.numerics import stochastic_round_bf16_
from trnflow.errors import FatalError
from trnflow.lifecycle.gate import SERIES, write_series
from trnflow.storage.datafiles import partitions
from trnflow.workload.checkpoint import RunCheckpoints, load_model_weights
from trnflow.workload.context import WorkerContext, barrier, gather_objects
from trnflow.workload.data import StepSampler, read_labelled
from trnflow.workload.evaluate import Holdout
from trnflow.workload.model import build_model
from trnflow.workload.programs import for_run
from trnflow.workload.start import Start, find_start
from trnflow.workload.tokenizer import TextTokenizer, train_tokenizer


def stochastic_rounding(precision: str) -> bool:
    """bf16-sr in the spec, or NEURON_RT_STOCHASTIC_ROUNDING_EN=1 with bf16, as the Neuron runtime does."""
    flag = os.environ.get("NEURON_RT_STOCHASTIC_ROUNDING_EN")
    return precision == "bf16-sr" or (precision == "bf16" and flag == "1")


@torch.no_grad()
def _round_weights(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every weight onto the bf16 grid, rounded stochastically (the same on every rank)."""
    for p in model.parameters():
        stochastic_round_bf16_(p.data, generator)


def _rng_state(sr_gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "sr": sr_gen.get_state()}


def _tokenizer(ctx: WorkerContext, start: Start, texts: list[str]) -> TextTokenizer:
    """The parent's tokenizer, or one trained on this run's corpus (by rank 0, shared with all)."""
    cfg = ctx.spec.model
    source = start.source
    if source is not None and source.tokenizer is not None:
        return TextTokenizer.from_json(source.tokenizer, cfg.seq_len, cfg.vocab_size, source.url)
    if source is not None:
        ctx.log("warning", message=f"{source.url} has no tokenizer.json beside it, so a new tokenizer is trained; "
                "put the tokenizer the weights were trained with beside the file to keep token ids")
    trained = train_tokenizer(texts, cfg.vocab_size, cfg.seq_len).to_json() if ctx.is_main else None
    shared = gather_objects(ctx, trained)[0]
    return TextTokenizer.from_json(shared, cfg.seq_len, cfg.vocab_size, "the trained tokenizer")


def _skipped(ctx: WorkerContext, start: Start) -> dict:
    mark = start.watermark or "none"
    reason = f"no training partitions after the watermark {mark} of {start.init.url if start.init else 'scratch'}"
    ctx.log("skipped", reason=reason)
    return {"skipped": True, "reason": reason, "watermark": start.watermark,
            "checkpoint": start.init.url if start.init else None, "steps_trained": 0}


def run(ctx: WorkerContext, run_id: str) -> dict:
    spec = ctx.spec
    cfg, tcfg = spec.model, spec.train
    start = find_start(ctx, run_id)
    if not start.files:
        return _skipped(ctx, start)
    texts = read_labelled(start.files, spec.data, cfg.num_classes, spec.data.train)
    assert texts.labels is not None
    tokenizer = _tokenizer(ctx, start, texts.texts)
    tokens, labels = tokenizer.encode(texts.texts), texts.labels

    model = build_model(cfg, tcfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    use_sr = stochastic_rounding(spec.compute.precision)
    # Replicas must round identically, so the rounding stream is seeded the same on every rank.
    sr_seed = int(os.environ.get("NEURON_RT_STOCHASTIC_ROUNDING_SEED", "0")) + tcfg.seed
    sr_gen = torch.Generator().manual_seed(sr_seed)
    sampler = StepSampler(len(labels), tcfg.global_batch_size, ctx.rank, ctx.world_size, tcfg.seed,
                          drop_last=tcfg.drop_last)

    first, resumed, metrics = 0, start.resumed, []
    if resumed is not None:
        load_model_weights(model, resumed.model, resumed.url)
        optimizer.load_state_dict(resumed.optim)
        first, metrics = sampler.restore(resumed.meta["sampler"]), list(resumed.meta.get("metrics", []))
        if resumed.rng and len(resumed.rng) == ctx.world_size:
            torch.set_rng_state(resumed.rng[ctx.rank]["torch"])
            sr_gen.set_state(resumed.rng[ctx.rank]["sr"])
        else:  # a different world size: per-rank streams cannot carry over, so derive new ones
            torch.manual_seed(tcfg.seed + 1000 * ctx.rank + first)
            sr_gen.manual_seed(sr_seed + first)
        ctx.log("resume", step=first, checkpoint=resumed.url, saved_by_ranks=len(resumed.rng or []),
                ranks=ctx.world_size)
    else:
        if start.init is not None:
            load_model_weights(model, start.init.model, start.init.url)
            ctx.log("init", checkpoint=start.init.url, watermark=start.init.watermark)
        torch.manual_seed(tcfg.seed + 1000 * ctx.rank)  # each rank its own dropout stream
        if use_sr:  # put the starting weights on the bf16 grid; resumed ones already are
            _round_weights(model, sr_gen)
    lineage = start.lineage()
    data_meta = {"files": [f.name for f in start.files], "partitions": partitions(start.files),
                 "watermark": start.watermark, "rows": len(labels)}
    ctx.log("data", files=len(start.files), rows=len(labels), partitions=data_meta["partitions"],
            watermark=start.watermark, tokenizer_vocab=tokenizer.vocab_size)

    programs = for_run(ctx, model, ddp=ctx.world_size > 1)
    holdout = Holdout(ctx, tokenizer)
    evaluations: list[dict] = list(resumed.meta.get("evaluations", [])) if resumed else []
    eval_every, series_url = spec.gate.eval_every, None
    window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
    began = time.perf_counter()
    memory: dict = {}
    step_times: list[float] = []  # the first step pays for loading (or compiling) the graph
    last_loss, checkpoint_url = float(resumed.meta.get("loss", "nan")) if resumed else float("nan"), None
    tear = False
    for step, idx in sampler.batches(first, tcfg.steps):
        due = ctx.faults.strike(step + 1, lambda fault: start.checkpoints.store.create(f"faults/{fault.label}",
                                                                                       ctx.faults.marker()))
        poison, tear = "nan" in due, tear or "torn" in due
        step_began = time.perf_counter()
        # Shapes are static, so the first step's saved activations are every step's.
        probe = saved_activation_peak() if not memory else contextlib.nullcontext({})
        with probe as saved:
            loss = programs.train_loss(tokens[idx], labels[idx])
        if poison:
            loss = loss * float("nan")
        if not math.isfinite(loss.item()):
            raise FatalError(
                f"loss is {loss.item()} at step {step + 1} on rank {ctx.rank}; the run diverged. "
                "Lower train.lr or use fp32; retrying would diverge again"
            )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if not memory:
            memory = _memory_held(model, optimizer, saved.get("peak", 0))
        if use_sr:
            _round_weights(model, sr_gen)
        last_loss, done = loss.item(), step + 1
        step_times.append(time.perf_counter() - step_began)
        window_steps, window_loss = window_steps + 1, window_loss + last_loss
        if done % tcfg.log_every == 0 or done == tcfg.steps:
            elapsed = time.perf_counter() - window_start
            # the mean over the steps since the last point: one batch's loss is too noisy to plot
            point = {"step": done, "global_step": lineage["base_step"] + done,
                     "loss": round(window_loss / window_steps, 5),
                     "samples_per_s": round(window_steps * tcfg.global_batch_size / elapsed, 1)}
            metrics.append(point)
            ctx.log("train", steps=tcfg.steps, **point)
            window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0
        if (eval_every and done % eval_every == 0) or done == tcfg.steps:
            point, correct = holdout.evaluate(programs, done, lineage["base_step"] + done)
            evaluations = [p for p in evaluations if p["step"] != done] + [point]
            if ctx.is_main:
                series_url = write_series(start.checkpoints.url, run_id, evaluations, holdout.digest, done, correct)
        if done % tcfg.checkpoint_every == 0 or done == tcfg.steps:
            rng = gather_objects(ctx, _rng_state(sr_gen))
            checkpoints = start.checkpoints
            if tear and ctx.is_main:  # a torn fault: the writing rank dies halfway through this checkpoint
                checkpoints = RunCheckpoints(checkpoints.url, TearingStore(checkpoints.store))
            if ctx.is_main:
                meta = {"run_id": run_id, **lineage, "global_step": lineage["base_step"] + done,
                        "spec_digest": spec.digest(), "precision": spec.compute.precision,
                        "world_size": ctx.world_size, "loss": last_loss, "sampler": sampler.position(done),
                        "data": data_meta, "watermark": start.watermark, "metrics": metrics,
                        "evaluations": evaluations, "holdout_sha256": holdout.digest,
                        "torch": torch.__version__}
                checkpoint_url = checkpoints.save(done, model.state_dict(), optimizer.state_dict(), rng,
                                                        tokenizer.to_json(), meta, keep_latest=tcfg.keep_latest)
                ctx.log("checkpoint", step=done, url=checkpoint_url)
            # No rank runs ahead while the checkpoint is written: a fault on another rank in the
            # next step would otherwise take rank 0 down mid-save and lose the interval.
            barrier(ctx)
            if tear:  # a torn fault on a rank that writes nothing: it is lost once the checkpoint is whole
                os.kill(os.getpid(), signal.SIGKILL)
    seconds = time.perf_counter() - began
    trained = tcfg.steps - first
    per_rank = gather_objects(ctx, memory.get("total", 0))
    if checkpoint_url is None and start.resumed is not None:  # resumed at the last step: nothing left to do
        checkpoint_url = start.resumed.url
    if series_url is None and evaluations:
        series_url = f"{start.checkpoints.url}/{SERIES}"
    return {
        "run_id": run_id,
        "checkpoint": checkpoint_url,
        "start_step": first,
        "steps": tcfg.steps,
        "steps_trained": trained,
        "resumed_from": start.resumed.url if start.resumed else None,
        "parent": lineage["parent"],
        "global_step": lineage["base_step"] + tcfg.steps,
        "watermark": start.watermark,
        "partitions": data_meta["partitions"],
        "rows": len(labels),
        "loss": last_loss,
        "evaluations": evaluations,
        "curve": metrics,
        "series": series_url,
        "holdout_sha256": holdout.digest,
        "samples_per_s": round(trained * tcfg.global_batch_size / seconds, 1) if trained else 0.0,
        "seconds": round(seconds, 3),
        "first_step_seconds": round(step_times[0], 4) if step_times else 0.0,
        "median_step_seconds": round(statistics.median(step_times[1:]), 5) if len(step_times) > 1 else 0.0,
        "compile": programs.compiler.summary(),
        "device_memory": {"estimated_per_core": estimate(spec).total, "peak_per_rank": per_rank, **memory},
    }


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
