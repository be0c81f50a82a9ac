"""What a checkpoint costs the training loop: written in the background (`train.checkpoint_async`,
the default) against written before training goes on, the same state in the same run.

    python benchmarks/goodput.py [--steps 24] [--every 4] [--repeats 2]

One core trains a model whose checkpoint takes seconds to write here (an m5-text encoder of about
90M parameters: a 1.1 GB checkpoint with its AdamW state), checkpointing every `--every` steps,
once with background writes and once without, `--repeats` times in turn. Each checkpoint's log line
says how long the loop stopped for it (`stalled_s`) and how long its write took (`wrote_s`); the
run's last checkpoint is written before the job ends either way, so it is left out of both.

The last line printed is JSON (`_report`'s shape). Goal: the stall per checkpoint written in the
background at most 5% of a checkpoint written in step, by the medians of the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, scratch_home
from _report import emit, ratio_figure

MODEL = {"vocab_size": 65536, "d_model": 1024, "n_heads": 8, "n_layers": 2, "ffn_dim": 4096, "mlp_hidden": [256]}
"""About 90M parameters, most of them in the embedding: a checkpoint of about 1.1 GB."""


def _stalls(log: str, last: int) -> tuple[list[float], list[float]]:
    """The stall and write seconds of each checkpoint the job logged, its last (at step `last`) aside."""
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"checkpoint"' in line]
    saved = [e for e in events if e.get("event") == "checkpoint" and e["step"] != last]
    return [e["stalled_s"] for e in saved], [e["wrote_s"] for e in saved]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        from trnflow.backends import JobRequest, JobState, wait
        from trnflow.backends.local import LocalBackend
        from trnflow.settings import TrnflowSettings

        backend = LocalBackend(TrnflowSettings().jobs_dir)

        def run(background: bool, repeat: int) -> tuple[list[float], list[float]]:
            name = f"{'background' if background else 'in-step'}-{repeat}"
            spec = quickstart(root, model={"recipe": "m5-text", "params": MODEL},
                              compute={"cores_per_node": 1}, compile={"cache_url": str(root / "cache")},
                              train={"steps": args.steps, "checkpoint_every": args.every, "log_every": args.steps,
                                     "global_batch_size": 16, "keep_latest": 1, "checkpoint_async": background,
                                     "checkpoint_url": str(root / "checkpoints")})
            job = backend.submit(JobRequest(spec, "train", name))
            info = wait(backend, job, 0.2)
            if info.state is not JobState.SUCCEEDED:
                raise SystemExit(f"training job {name} failed: {info.failed()}")
            stalls, writes = _stalls(backend.logs(job)[0], args.steps)
            print(f"{name}: stalled {', '.join(f'{s:.3f}' for s in stalls)} s per checkpoint; writes took "
                  f"{', '.join(f'{w:.2f}' for w in writes)} s; median step {info.result.median_step_seconds:.3f} s")
            return stalls, writes

        ours, theirs, written = [], [], []
        for repeat in range(args.repeats):
            stalls, writes = run(True, repeat)
            ours.append(statistics.median(stalls))
            written.append(statistics.median(writes))
            stalls, _ = run(False, repeat)
            theirs.append(statistics.median(stalls))
        print(f"stall per checkpoint: background {statistics.median(ours):.3f} s, in step "
              f"{statistics.median(theirs):.3f} s ({statistics.median(ours) / statistics.median(theirs):.1%})")
        emit("goodput", [
            ratio_figure("training stall per checkpoint, written in the background", ours, theirs, unit="s",
                         baseline_name="written in step", better="lower", goal=0.05),
        ], steps=args.steps, every=args.every, background_write_s=written, model=MODEL)


if __name__ == "__main__":
    main()
