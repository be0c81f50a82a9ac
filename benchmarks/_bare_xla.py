"""A plain torch-xla training loop (one process, lazy tensors): the baseline of xla_overhead.py.

    PJRT_DEVICE=CPU python _bare_xla.py SPEC_JSON STEPS SYNCS

Same model, per-core batch, optimizer and sequence length as the spec; random token ids stand in
for the data (the step costs the same). SYNCS is 1 (`torch_xla.sync()` after the optimizer step, the
usual loop) or 2 (after backward too). Prints one JSON line with the median step time after the
first step, as trnflow's training result reports it.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch_xla

from trnflow.specs import JobSpec
from trnflow.workload.programs import build_model
from trnflow.workload.recipes import recipe_for


def main() -> None:
    spec = JobSpec.model_validate_json(Path(sys.argv[1]).read_text())
    steps, syncs = int(sys.argv[2]), int(sys.argv[3])
    device = torch_xla.device()
    recipe, batch = recipe_for(spec), spec.per_core_batch
    model = build_model(recipe, spec.train.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.train.lr, weight_decay=spec.train.weight_decay)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.stack([recipe.example(batch, gen) for _ in range(steps)])
    labels = torch.randint(0, recipe.num_classes, (steps, batch), generator=gen)
    times = []
    for step in range(steps):
        began = time.perf_counter()
        loss = F.cross_entropy(model(tokens[step].to(device)).float(), labels[step].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if syncs == 2:
            torch_xla.sync()
        optimizer.step()
        torch_xla.sync()
        loss.item()
        times.append(time.perf_counter() - began)
    print(json.dumps({"median_step_seconds": statistics.median(times[1:])}), flush=True)


if __name__ == "__main__":
    main()
