"""A bare PyTorch tensor-parallel training loop (gloo, DTensor): the baseline of tensor_parallel.py.

    torchrun --nproc-per-node N _bare_tp.py SPEC_JSON STEPS

The spec's model (a Llama-style decoder from hf-causal-lm), its projections split over the N ranks
with PyTorch's own `parallelize_module` (ColwiseParallel on q, k, v, gate and up; RowwiseParallel on
o and down), AdamW over its parameters, and every rank on the same batches: the spec's holdout texts,
featurized by the recipe, each step's rows picked by trnflow's sampler for one replica. Run eagerly,
as trnflow's optlevel 1 runs its captured graphs. Rank 0 prints one JSON line with the median step time.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from trnflow.specs import JobSpec
from trnflow.workload.data import read_unlabelled
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for
from trnflow.workload.sampler import StepSampler

COLUMNS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWS = ("self_attn.o_proj", "mlp.down_proj")


def main() -> None:
    spec = JobSpec.model_validate_json(Path(sys.argv[1]).read_text())
    steps = int(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    allowed = sorted(os.sched_getaffinity(0))  # each rank on a CPU of its own, as trnflow's workers are
    if len(allowed) >= dist.get_world_size():
        os.sched_setaffinity(0, [allowed[int(os.environ["LOCAL_RANK"])]])
    recipe = recipe_for(spec)
    texts = read_unlabelled(spec.data.holdout, spec.data, recipe.columns()).table
    recipe.fit(texts)
    features = recipe.features(texts)
    model = build_model(recipe, spec.train.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.lm.model.layers:
        parallelize_module(layer, mesh, {**{p: ColwiseParallel() for p in COLUMNS},
                                         **{p: RowwiseParallel() for p in ROWS}})
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, weight_decay=spec.train.weight_decay)
    sampler = StepSampler(len(features), spec.train.global_batch_size, 0, 1, spec.train.seed)
    times = []
    for _, idx in sampler.batches(0, steps):
        began = time.perf_counter()
        scores = model(features[idx])  # per row: summed token loss, tokens, right guesses
        loss = scores[:, 0].sum() / scores[:, 1].sum().clamp_min(1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - began)
    if rank == 0:
        print(json.dumps({"median_step_seconds": statistics.median(times[2:])}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
