"""The training phase: DDP over gloo, one rank per NeuronCore, resumable from its own checkpoints.

A run's checkpoints live under `<checkpoint_url>/<run_id>/`. A retried attempt of the same run
finds its newest committed checkpoint there and continues from that exact step and sample; a new
run starts from `train.init_from` (or from scratch).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

import torch

from trnflow.emulator.memory import estimate, saved_activation_peak, tensor_bytes
from trnflow.emulator.numerics import stochastic_round_bf16_
from trnflow.errors import FatalError
from trnflow.storage import join, local_path
from trnflow.workload.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.data import HashingTokenizer, StepSampler, load_labelled
from trnflow.workload.model import build_model
from trnflow.workload.programs import for_run


def stochastic_rounding(precision: str) -> bool:
    """bf16-sr in the spec, or NEURON_RT_STOCHASTIC_ROUNDING_EN=1 with bf16, as the Neuron runtime does."""
    flag = os.environ.get("NEURON_RT_STOCHASTIC_ROUNDING_EN")
    return precision == "bf16-sr" or (precision == "bf16" and flag == "1")


def _rng_state(sr_gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "sr": sr_gen.get_state()}


def run(ctx: WorkerContext, run_id: str) -> dict:
    spec = ctx.spec
    cfg, tcfg = spec.model, spec.train
    tokenizer = HashingTokenizer(cfg.vocab_size, cfg.seq_len)
    data = load_labelled(spec.data.train, spec.data, tokenizer, cfg.num_classes)
    assert data.labels is not None

    model = build_model(cfg, tcfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    use_sr = stochastic_rounding(spec.compute.precision)
    # Replicas must round identically, so the rounding stream is seeded the same on every rank.
    sr_seed = int(os.environ.get("NEURON_RT_STOCHASTIC_ROUNDING_SEED", "0")) + tcfg.seed
    sr_gen = torch.Generator().manual_seed(sr_seed)

    run_url = join(tcfg.checkpoint_url, run_id)
    run_dir = local_path(run_url)
    start, parent, resumed_from, last_loss = 0, tcfg.init_from, None, float("nan")
    latest = latest_checkpoint(run_dir)
    if latest is not None:
        ckpt = load_checkpoint(latest)
        load_model_weights(model, ckpt.model, latest)
        optimizer.load_state_dict(ckpt.optim)
        start, parent, resumed_from = ckpt.step, ckpt.meta.get("parent"), str(latest)
        last_loss = float(ckpt.meta.get("loss", last_loss))
        if ckpt.rng and len(ckpt.rng) == ctx.world_size:
            torch.set_rng_state(ckpt.rng[ctx.rank]["torch"])
            sr_gen.set_state(ckpt.rng[ctx.rank]["sr"])
        else:  # a different world size: per-rank streams cannot carry over, so derive new ones
            torch.manual_seed(tcfg.seed + 1000 * ctx.rank + start)
        ctx.log("resume", step=start, checkpoint=str(latest))
    else:
        if tcfg.init_from:
            source = local_path(tcfg.init_from)
            init = load_checkpoint(source)
            load_model_weights(model, init.model, source)
            ctx.log("init", checkpoint=str(source))
        torch.manual_seed(tcfg.seed + 1000 * ctx.rank)  # each rank its own dropout stream
    if use_sr and latest is None:  # put fresh weights on the bf16 grid; resumed ones already are
        with torch.no_grad():
            for p in model.parameters():
                stochastic_round_bf16_(p.data, sr_gen)

    programs = for_run(ctx, model, ddp=ctx.world_size > 1)
    sampler = StepSampler(len(data.labels), tcfg.global_batch_size, ctx.rank, ctx.world_size, tcfg.seed,
                          drop_last=tcfg.drop_last)
    window_start, window_steps = time.perf_counter(), 0
    began = time.perf_counter()
    memory: dict = {}
    step_times: list[float] = []  # the first step pays for loading (or compiling) the graph
    for step, idx in sampler.batches(start, tcfg.steps):
        step_began = time.perf_counter()
        tokens, labels = data.tokens[idx], data.labels[idx]
        # Shapes are static, so the first step's saved activations are every step's.
        probe = saved_activation_peak() if not memory else contextlib.nullcontext({})
        with probe as saved:
            loss = programs.train_loss(tokens, labels)
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
            with torch.no_grad():
                for p in model.parameters():
                    stochastic_round_bf16_(p.data, sr_gen)
        last_loss, done = loss.item(), step + 1
        step_times.append(time.perf_counter() - step_began)
        window_steps += 1
        if done % tcfg.log_every == 0 or done == tcfg.steps:
            elapsed = time.perf_counter() - window_start
            ctx.log("train", step=done, steps=tcfg.steps, loss=round(last_loss, 5),
                    samples_per_s=round(window_steps * tcfg.global_batch_size / elapsed, 1))
            window_start, window_steps = time.perf_counter(), 0
        if done % tcfg.checkpoint_every == 0 or done == tcfg.steps:
            rng = gather_objects(ctx, _rng_state(sr_gen))
            if ctx.is_main:
                meta = {"run_id": run_id, "parent": parent, "spec_digest": spec.digest(),
                        "precision": spec.compute.precision, "world_size": ctx.world_size,
                        "loss": last_loss, "torch": torch.__version__}
                path = save_checkpoint(run_dir, done, model.state_dict(), optimizer.state_dict(), rng, meta)
                ctx.log("checkpoint", step=done, path=str(path))
    seconds = time.perf_counter() - began
    trained = tcfg.steps - start
    per_rank = gather_objects(ctx, memory.get("total", 0))
    final = latest_checkpoint(run_dir)
    return {
        "run_id": run_id,
        "checkpoint": final.as_uri() if final else None,
        "start_step": start,
        "steps": tcfg.steps,
        "steps_trained": trained,
        "resumed_from": resumed_from,
        "loss": last_loss,
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
