"""Sharded training (`train.parallelism.strategy: fsdp`): its speed against a bare FSDP2 loop and
against trnflow's own `ddp`, and the state each rank holds at 2 and 4 cores.

- Speed: trnflow's training stage under `fsdp` against a bare PyTorch FSDP2 loop of the same model,
  blocks, batch and ranks (`_bare_ddp.py fsdp`: `fully_shard` per recipe block, then the root, one
  thread per rank pinned to a CPU of its own, as trnflow's workers are with
  `compute.threads_per_core: 1`), and trnflow's `ddp` on the same spec, repeats interleaved so that
  drift hits all alike. Each reports its median step after the graph is loaded. Goal: at least 0.95x
  the bare loop's samples/s; the `fsdp`/`ddp` ratio is reported (on a model that fits one core,
  `ddp` does less work: no gathers).
- Memory: the bytes of weights and optimizer state rank 0 holds (FSDP2 splits each weight as
  `torch.chunk` does, so rank 0 holds the most), measured in a training job of a few steps, under
  `fsdp` at N = 2 and 4 ranks against `ddp`'s. Goal: 1/N of `ddp`'s, within 10% either way.

    python benchmarks/sharded_train.py [--steps 200] [--ranks 2] [--repeats 6]

The last line printed is JSON (`_report`'s shape).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, run_job, scratch_home
from _report import difference_figure, emit, ratio_figure
from _torchrun import torchrun_json

from trnflow.backends.local import LocalBackend
from trnflow.settings import TrnflowSettings


def _spec(root: Path, ranks: int, steps: int, strategy: str):
    return quickstart(root, compute={"cores_per_node": ranks, "instance_type": "trn1.32xlarge", "precision": "fp32",
                                     "threads_per_core": 1},
                      compile={"cache_url": str(root / "cache")},
                      train={"steps": steps, "checkpoint_every": max(1, steps // 2), "log_every": 10,
                             "parallelism": {"strategy": strategy}})


def _held(result: dict) -> int:
    """The bytes of weights and optimizer state rank 0 held."""
    return result["device_memory"]["weights"] + result["device_memory"]["optimizer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        scratch_home(root)
        backend = LocalBackend(TrnflowSettings().jobs_dir)
        held: dict[tuple[str, int], int] = {}
        for ranks in (2, 4):  # the state each rank holds: a few steps are enough
            for strategy in ("ddp", "fsdp"):
                result = run_job(backend, _spec(root, ranks, 4, strategy), "train", f"memory-{strategy}-{ranks}")
                held[strategy, ranks] = _held(result)
        spec = {s: _spec(root, args.ranks, args.steps, s) for s in ("ddp", "fsdp")}
        spec_file = root / "spec.json"
        spec_file.write_text(spec["fsdp"].model_dump_json())
        for strategy in ("ddp", "fsdp"):  # each train program into the cache once
            run_job(backend, spec[strategy], "train", f"warm-up-{strategy}")
        times: dict[str, list[float]] = {"fsdp": [], "ddp": [], "bare": []}
        runs = tuple(times)
        for i in range(args.repeats):
            for what in runs[i % len(runs):] + runs[:i % len(runs)]:
                if what == "bare":
                    step = torchrun_json("_bare_ddp.py", args.ranks, spec_file, args.steps, "fsdp")
                else:
                    step = run_job(backend, spec[what], "train", f"run-{what}-{i}")
                times[what].append(step["median_step_seconds"])
            print(f"repeat {i + 1}: step ms " + ", ".join(f"{w} {times[w][-1] * 1000:.2f}" for w in runs), flush=True)
    batch = spec["fsdp"].train.global_batch_size
    rate = {w: [batch / s for s in times[w]] for w in runs}
    medians = {w: batch / statistics.median(times[w]) for w in runs}
    print(f"{args.ranks} ranks, global batch {batch}, fp32: trnflow fsdp {medians['fsdp']:.1f} samples/s, bare FSDP2 "
          f"{medians['bare']:.1f}, trnflow ddp {medians['ddp']:.1f} (medians of {args.repeats})")
    shares = {n: held["fsdp", n] / held["ddp", n] for n in (2, 4)}
    for n, share in shares.items():
        print(f"{n} ranks: rank 0 holds {held['fsdp', n] / 2**20:.2f} MiB of weights and optimizer state under fsdp, "
              f"{held['ddp', n] / 2**20:.2f} MiB under ddp: {share:.3f} of it (1/{n} = {1 / n:.3f})")
    figures = [
        ratio_figure("fsdp training samples/s", rate["fsdp"], rate["bare"], unit="samples/s",
                     baseline_name="bare FSDP2 loop", goal=0.95),
        ratio_figure("fsdp against ddp, samples/s", rate["fsdp"], rate["ddp"], unit="samples/s",
                     baseline_name="trnflow ddp"),
        # 1/N within 10%, either way: the share rank 0 holds over 1/N, within 0.1 of 1
        *(difference_figure(f"state on rank 0 under fsdp over 1/{n} of ddp's", [share * n], [1.0], unit="x",
                            baseline_name=f"1/{n}", goal=0.1) for n, share in shares.items()),
    ]
    emit("sharded_train", figures, ranks=args.ranks, steps=args.steps,
         step_seconds=times, state_bytes_per_rank={f"{s}-{n}": b for (s, n), b in held.items()},
         share_of_ddp={str(n): round(s, 4) for n, s in shares.items()})


if __name__ == "__main__":
    main()
