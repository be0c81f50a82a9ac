"""The one program that runs on the cores: `python -m trnflow.workload <phase> --spec FILE`.

Every backend launches this same entrypoint under torchrun. Rank 0 writes `result.json` to the
output directory; a rank that fails writes `failure-rank<r>.json` there (the analogue of
SageMaker's /opt/ml/output/failure) before exiting non-zero.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from trnflow.device.tracing import preload_tracing
from trnflow.errors import ExitCode, FatalError, TrnflowError
from trnflow.fsutil import atomic_write_json
from trnflow.results import RESULTS, DeviceUsed, FailureReport, StageResult
from trnflow.specs import JobSpec, SpecError, load_spec, run_id_problem

PHASES = ("sanity", "collectives", "compile", "train", "evaluate", "infer")


def _run_id(value: str) -> str:
    if problem := run_id_problem(value):
        raise argparse.ArgumentTypeError(problem)
    return value


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trnflow.workload", description=__doc__)
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--spec", type=Path, default=None,
                        help="job spec as JSON, written by the backend (sanity and collectives can run without)")
    parser.add_argument("--options", type=Path, default=None, help="phase options as JSON (collective sweep sizes)")
    parser.add_argument("--output", type=Path, default=None,
                        help="result directory (default: $SM_OUTPUT_DATA_DIR, then ./output)")
    parser.add_argument("--run-id", default="adhoc", type=_run_id, help="names the run's checkpoint folder")
    parser.add_argument("--checkpoint", default=None, help="checkpoint URL for evaluate and infer")
    parser.add_argument("--budget-usd", type=_budget, default=None,
                        help="train: what the job may cost, in US dollars at on-demand prices (the orchestrator's "
                        "reckoning of the run's budget); unset: no limit")
    return parser.parse_args(argv)


def _budget(value: str) -> float:
    budget = float(value)
    if not budget >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"{value} is not an amount of US dollars (0 or more)")
    return budget


def _dispatch(args: argparse.Namespace, ctx) -> StageResult | dict:
    """Run the phase; only its own module is imported, since each import costs every worker's start."""

    if args.phase in ("evaluate", "infer") and not args.checkpoint:
        raise TrnflowError(f"{args.phase} needs --checkpoint")
    phase = importlib.import_module(f"trnflow.workload.{args.phase}")
    match args.phase:
        case "train":
            return phase.run(ctx, args.run_id, args.budget_usd)
        case "sanity":
            return phase.run(ctx, args.run_id)
        case "evaluate" | "infer":
            return phase.run(ctx, args.checkpoint)
        case _:
            return phase.run(ctx)


COMPILED = ("compile", "train", "evaluate", "infer")
"""The phases that run programs through TorchDynamo."""
READ_DATA = ("train", "evaluate", "infer")
"""The phases that read the run's data."""


def preload(argv: list[str]) -> None:
    """What a launcher that forks this program's ranks imports first, so that each rank finds it
    imported: the worker's set-up, the phase's module, what pyarrow loads at its first conversion for
    the phases that read data, and TorchDynamo for the phases that compile (together about 2 CPU-s
    a process)."""
    from trnflow.workload import context  # noqa: F401 (torch: the launcher has it already)

    phase = argv[0] if argv and argv[0] in PHASES else None
    if phase is not None:
        importlib.import_module(f"trnflow.workload.{phase}")
    if phase in READ_DATA:
        from trnflow.workload import data  # pyarrow: only the phases that read data load it

        data.preload()
    if phase in COMPILED:
        preload_tracing()  # TorchDynamo: seconds, worth loading once for every rank
    spec = argv[argv.index("--spec") + 1] if "--spec" in argv[:-1] else None
    preload_recipe(phase, Path(spec) if spec else None)


def preload_recipe(phase: str | None, spec: Path | None, own_only: bool = False) -> None:
    """The libraries the spec's recipe builds its model with (`Recipe.preloads`), for the phases that
    build it, imported into this process for the processes forked from it. With `own_only`, only for
    trnflow's own recipes: a process that outlives the job (the local fork server) must not hold a
    user's recipe module as it was when it first imported it. Nothing here fails a job: what cannot
    be read or imported is left to the job itself, which says what is wrong."""
    if phase not in COMPILED or spec is None:
        return
    from trnflow.workload.recipes import installed, recipe_class  # the recipes' models: torch

    try:
        name = json.loads(spec.read_text())["model"]["recipe"]
        if own_only and not installed().get(name, "").startswith("trnflow."):
            return
        for module in recipe_class(name).preloads:
            importlib.import_module(module)
    except (OSError, ValueError, KeyError, TypeError, ImportError, TrnflowError):
        return


def _typed(phase: str, result: StageResult | dict, ctx) -> StageResult:
    """The phase's result as the model the orchestrator reads it with (`trnflow.results.RESULTS`),
    with the device it ran on: a phase that still returns a mapping is checked against that model
    here, so a result that would not read on the other side fails the job that wrote it."""
    device = DeviceUsed(name=ctx.device.name, reason=ctx.device_reason)
    if isinstance(result, StageResult):
        return result.model_copy(update={"phase": phase, "device": device})
    return RESULTS[phase].model_validate({**result, "phase": phase, "device": device})


def _spec(path: Path) -> JobSpec:
    """The job spec the backend wrote (JSON, which the YAML loader reads too), its layout decided."""
    try:
        from trnflow.workload.recipes import RECIPES  # the recipes' models: torch, imported after the arguments

        spec = load_spec(path, model=RECIPES)
    except SpecError as exc:
        raise FatalError(str(exc)) from None
    if not spec.decided:  # every submission decides it (`backends.base.fitted`)
        raise FatalError(f"{path}: train.parallelism or train.activation_checkpointing: `auto` reached a job "
                         "undecided; submit jobs through a backend, which decides the layout before the job starts")
    return spec


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    output = args.output or Path(os.environ.get("SM_OUTPUT_DATA_DIR", "output"))
    rank = int(os.environ.get("RANK", "0"))
    from trnflow.workload.context import init_worker, shutdown  # torch: after the arguments are checked

    try:
        spec = _spec(args.spec) if args.spec else None
        if spec is None and args.phase not in ("sanity", "collectives"):
            raise TrnflowError(f"{args.phase} needs --spec")
        options = json.loads(args.options.read_text()) if args.options else {}
        ctx = init_worker(spec, output, args.phase, options, args.run_id)
        ctx.write_result(_typed(args.phase, _dispatch(args, ctx), ctx))
        shutdown()
        return ExitCode.OK
    except BaseException as exc:
        if isinstance(exc, SystemExit | KeyboardInterrupt):
            raise
        atomic_write_json(output / f"failure-rank{rank}.json", FailureReport(
            rank=rank, type=type(exc).__name__, message=str(exc), retryable=getattr(exc, "retryable", None),
            bad_cores=getattr(exc, "bad_cores", []), traceback=traceback.format_exc()).model_dump(exclude_none=True))
        print(f"trnflow.workload {args.phase} failed on rank {rank}: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)
        return ExitCode.FAILED


def _exit(code: int) -> None:
    """Leave without tearing down the interpreter's C++ side. Everything is written by now; what is
    left are torch's native threads, whose destructors can abort a finished worker (SIGABRT,
    "terminate called without an active exception") and turn a complete run into a failed one."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main())
