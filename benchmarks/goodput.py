"""What a checkpoint costs the training loop, and what a faulted run loses: checkpoints written in
the background (`train.checkpoint_async`, the default) against written before training goes on.

    python benchmarks/goodput.py [--part stall|faulted|both] [--steps 40] [--every 4] [--repeats 3]
                                 [--faulted-steps 300] [--faulted-every 10] [--faulted-runs background,in-step]

`stall`: one core trains a model whose checkpoint takes seconds to write here (an m5-text encoder of
about 90M parameters: a 1.1 GB checkpoint with its AdamW state), checkpointing every `--every`
steps, once with background writes and once without, `--repeats` times in turn (which goes first
alternating, so that a machine drifting over the runs weighs on both alike), the core computing
on one CPU as in `faulted` below. A checkpoint's cost is what the loop stopped for it (its log
line's `stalled_s`) and, written in the background, what the steps beside its write took over as
many means of recent steps that ran alone (`slowed_s`): both are in the run's `time.stall_seconds`. The
figures are the medians over a run's checkpoints (the first background one also starts the writer
process and its memory: about a second and a half here, once a run). The run's last checkpoint is
written before the job ends either way, so it is left out of both.

`faulted`: the whole pipeline of the same model on one core, `--faulted-steps` steps with a
checkpoint every `--faulted-every`, hit by one fault every 100 steps, each halfway between two
checkpoints: the rank killed (SIGKILL) at step 105, stalled at step 205 (its watchdog ends it
within a few median steps: compute.hang_floor_seconds 10) and its loss spiking at step 255 (rolled
back: train.on_divergence: rollback); once with background writes and once without, the programs
compiled into the cache before both. The emulated core computes on one CPU
(`compute.threads_per_core: 1`), leaving the machine's other to the host's own work, the background
writes among it, as on a trn instance, where the device computes and the host's CPUs are free;
without that, a write here takes its CPU from the training itself, which a device never lends. The
gate evaluates after training, not during it (`gate.eval_every: null`): evaluations are the user's
choice of cost, not a fault's. Its goodput (the training the final weights hold over the compile
and train stages' time, less the holdout's evaluation of the final weights that follows them:
`cost.goodput`) is read from the run's outcome, with the losses itemized.

The last line printed is JSON (`_report`'s shape). Goals: the whole cost per checkpoint written in
the background at most 5% of a checkpoint written in step, by the medians of the repeats; the faulted
run with background writes losing at most 10% of its time (goodput at least 90%).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from _quickstart import quickstart, scratch_home
from _report import emit, limit_figure, ratio_figure

MODEL = {"vocab_size": 65536, "d_model": 1024, "n_heads": 8, "n_layers": 2, "ffn_dim": 4096, "mlp_hidden": [256]}
"""About 90M parameters, most of them in the embedding: a checkpoint of about 1.1 GB."""


def _checkpoints(log: str) -> dict[int, dict]:
    """The checkpoint events the job logged, by step."""
    events = [json.loads(line) for line in log.splitlines() if line.startswith("{") and '"checkpoint"' in line]
    return {e["step"]: e for e in events if e.get("event") == "checkpoint"}


FAULTS = [{"kind": "kill", "core": 0, "step": 105, "phase": "train"},
          {"kind": "stall", "core": 0, "step": 205, "phase": "train"},
          {"kind": "spike", "core": 0, "step": 255, "phase": "train"}]
"""One fault every 100 steps, each halfway between two checkpoints: a lost process, a hung one, a loss spike."""


def _stall_part(args: argparse.Namespace, root: Path) -> list[dict]:
    from trnflow.backends import JobRequest, JobState, wait
    from trnflow.backends.local import LocalBackend
    from trnflow.settings import TrnflowSettings

    backend = LocalBackend(TrnflowSettings().jobs_dir)

    def run(background: bool, repeat: int) -> tuple[float, float, float]:
        """The loop's stop per checkpoint, its whole cost per checkpoint and the write's seconds,
        each checkpoint but the last (written before the job ends either way)."""
        name = f"{'background' if background else 'in-step'}-{repeat}"
        spec = quickstart(root, model={"recipe": "m5-text", "params": MODEL},
                          compute={"cores_per_node": 1, "threads_per_core": 1},
                          compile={"cache_url": str(root / "cache")},
                          train={"steps": args.steps, "checkpoint_every": args.every, "log_every": args.steps,
                                 "global_batch_size": 16, "keep_latest": 1, "checkpoint_async": background,
                                 "checkpoint_url": str(root / "checkpoints")})
        job = backend.submit(JobRequest(spec, "train", name))
        info = wait(backend, job, 0.2)
        if info.state is not JobState.SUCCEEDED:
            raise SystemExit(f"training job {name} failed: {info.failed()}")
        saved = _checkpoints(backend.logs(job)[0])
        saved.pop(args.steps)
        stops = [e["stalled_s"] for e in saved.values()]
        # and what the steps that shared the host with its write took over as many that ran alone
        wholes = [e["stalled_s"] + e["slowed_s"] for e in saved.values()]
        writes = [e["wrote_s"] for e in saved.values()]
        writers = "/".join(sorted({e["writer"] for e in saved.values()}))
        print(f"{name}: stopped {', '.join(f'{s:.3f}' for s in stops)} s at each checkpoint, "
              f"{', '.join(f'{s:.3f}' for s in wholes)} s in all with the steps slowed beside its write; writes "
              f"took {', '.join(f'{w:.2f}' for w in writes)} s ({writers}); median step "
              f"{info.result.median_step_seconds:.3f} s", flush=True)
        return statistics.median(stops), statistics.median(wholes), statistics.median(writes)

    stops, wholes, theirs, written = [], [], [], []
    for repeat in range(args.repeats):
        # in turn, which goes first alternating, so that a machine drifting over the runs weighs on both alike
        if repeat % 2:
            theirs.append(run(False, repeat)[1])
        stop, whole, wrote = run(True, repeat)
        stops.append(stop)
        wholes.append(whole)
        written.append(wrote)
        if not repeat % 2:
            theirs.append(run(False, repeat)[1])
    print(f"per checkpoint: background {statistics.median(wholes):.3f} s in all ({statistics.median(stops):.3f} s "
          f"stopped), in step {statistics.median(theirs):.3f} s "
          f"({statistics.median(wholes) / statistics.median(theirs):.1%})")
    args.details["background_write_s"] = written
    return [ratio_figure("training stall per checkpoint, written in the background", wholes, theirs, unit="s",
                         baseline_name="written in step", better="lower", goal=0.05),
            ratio_figure("training stopped per checkpoint at the step boundary, written in the background", stops,
                         theirs, unit="s", baseline_name="written in step", better="lower")]


def _faulted_part(args: argparse.Namespace, root: Path) -> list[dict]:
    from trnflow.flows.compile import compile_cache
    from trnflow.flows.pipeline import pipeline

    measured: dict[str, dict] = {}
    modes = [m for m, wanted in ((None, True), (True, "background" in args.faulted_runs),
                                 (False, "in-step" in args.faulted_runs)) if wanted]
    for background in modes:  # None: the programs compiled first, for every run alike
        mode = {None: "warm-up", True: "background", False: "in-step"}[background]
        spec = quickstart(root, name=f"faulted-{mode}", model={"recipe": "m5-text", "params": MODEL},
                          compute={"cores_per_node": 1, "hang_floor_seconds": 10, "threads_per_core": 1},
                          compile={"cache_url": str(root / "cache")}, gate={"eval_every": None},
                          train={"steps": args.faulted_steps, "checkpoint_every": args.faulted_every,
                                 "log_every": 10, "global_batch_size": 16, "keep_latest": 2,
                                 "checkpoint_async": bool(background), "on_divergence": "rollback",
                                 "checkpoint_url": str(root / f"checkpoints-{mode}")},
                          retries={"max_retries": 3, "backoff_seconds": 0},
                          faults=[f for f in FAULTS if f["step"] <= args.faulted_steps])
        if background is None:
            compile_cache(spec)
            continue
        outcome = pipeline(spec, run_id=f"faulted-{mode}", force_promote="the benchmark measures it")
        good = outcome.cost.goodput
        if good is None:
            raise SystemExit(f"the faulted {mode} run measured no goodput: {outcome.stages}")
        print(f"faulted run, checkpoints {mode}: goodput {good}", flush=True)
        measured[mode] = good.model_dump()
    args.details["faulted"] = measured
    figures = []
    if "background" in measured:
        figures.append(limit_figure("time lost by the faulted run, written in the background",
                                    [1 - measured["background"]["fraction"]], 0.10,
                                    unit="share of the compile and train stages"))
    if len(measured) == 2:
        figures.append(ratio_figure("goodput of the faulted run, written in the background",
                                    [measured["background"]["fraction"]], [measured["in-step"]["fraction"]],
                                    unit="share", baseline_name="written in step", better="higher"))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("stall", "faulted", "both"), default="both")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=4, help="steps between checkpoints")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--faulted-steps", type=int, default=300)
    parser.add_argument("--faulted-every", type=int, default=10, help="steps between the faulted run's checkpoints")
    parser.add_argument("--faulted-runs", default="background,in-step",
                        help="which faulted runs: background, in-step, or both (comma-separated)")
    args = parser.parse_args()
    args.details = {"model": MODEL, "steps": args.steps, "every": args.every}
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-") as tmp:
        root = Path(tmp)
        scratch_home(root)
        figures = []
        if args.part in ("stall", "both"):
            figures += _stall_part(args, root)
        if args.part in ("faulted", "both"):
            figures += _faulted_part(args, root)
        emit("goodput", figures, **args.details)


if __name__ == "__main__":
    main()
