"""The baseline: a bare torch.distributed all-reduce loop on gloo, launched by torchrun.

Prints one JSON line from rank 0: {"size": B, "seconds": per-iteration time (slowest rank)}.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main(size: int, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    buf = torch.ones(size // 4)
    dist.all_reduce(buf)  # warm-up
    dist.barrier()
    began = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    took = torch.tensor([(time.perf_counter() - began) / iters])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"size": size, "seconds": took.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
