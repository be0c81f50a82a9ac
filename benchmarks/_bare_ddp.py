"""A bare PyTorch data-parallel training loop (gloo): DDP eager or under torch.compile, the baselines
of train_throughput.py; or FSDP2 (`fully_shard` per recipe block, then the root, eager), the baseline
of sharded_train.py.

    torchrun --nproc-per-node N _bare_ddp.py SPEC_JSON STEPS eager|compiled|fsdp

Same model, per-core batch, optimizer and sequence length as the spec, and the same kind of data: the
spec's holdout texts, tokenized by the recipe's featurizer fitted on them (padded to the sequence
length as the training job's are), each step's rows picked by trnflow's own sampler. Rank 0 prints
one JSON line with the median step time.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from trnflow.specs import JobSpec
from trnflow.workload.data import read_unlabelled
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for
from trnflow.workload.sampler import StepSampler


def main() -> None:
    spec = JobSpec.model_validate_json(Path(sys.argv[1]).read_text())
    steps, mode = int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    # Each rank on a CPU of its own, as trnflow's workers are with compute.threads_per_core: 1.
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) >= dist.get_world_size():
        os.sched_setaffinity(0, [allowed[int(os.environ["LOCAL_RANK"])]])
    recipe, batch = recipe_for(spec), spec.per_core_batch
    model = build_model(recipe, spec.train.seed)
    if mode == "fsdp":  # each block its own unit, then the rest of the model, as trnflow shards it
        from torch.distributed.fsdp import fully_shard

        for block in recipe.blocks(model):
            fully_shard(block)
        fully_shard(model)
    else:  # compiled as trnflow compiles it: the model's own graph, with DDP around it
        model = DDP(torch.compile(model) if mode == "compiled" else model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, weight_decay=spec.train.weight_decay)
    texts = read_unlabelled(spec.data.holdout, spec.data, recipe.columns()).table
    recipe.fit(texts)
    features = recipe.features(texts)
    sampler = StepSampler(len(features), spec.train.global_batch_size, rank, dist.get_world_size(), spec.train.seed)
    tokens = torch.stack([features[idx] for _, idx in sampler.batches(0, steps)])
    gen = torch.Generator().manual_seed(rank)
    labels = torch.randint(0, recipe.num_classes, (steps, batch), generator=gen)
    times = []
    for step in range(steps):
        began = time.perf_counter()
        loss = F.cross_entropy(model(tokens[step]).float(), labels[step])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()
        times.append(time.perf_counter() - began)
    if rank == 0:
        # The first steps load or compile the graph (a compiled DDP model settles over the first two).
        print(json.dumps({"mode": mode, "median_step_seconds": statistics.median(times[2:])}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
