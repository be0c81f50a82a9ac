"""The ahead-of-time compile phase, like neuron_parallel_compile: a trial run extracts every
program's graph (nothing is trained or saved), each key is looked up in the persistent cache, and
the misses are compiled by a pool of `compile.workers` processes, one program's graphs in each.

Options: `check` (only say which graphs would hit or miss) and `retry_failed` (compile entries
that failed before, which are otherwise remembered and skipped; `--retry_failed_compilation` in
NEURON_CC_FLAGS asks for it too).
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trnflow.device import cache as states
from trnflow.device import plans
from trnflow.device.base import Device
from trnflow.device.cache import COMPILER_VERSION, CompileCache, EntryLocked, entry_name
from trnflow.device.registry import choose, get_device
from trnflow.errors import FatalError
from trnflow.measures import ParallelCompile, ProgramOutcome, ProgramPlan
from trnflow.neuron.compile_log import CompileProgress
from trnflow.neuron.launch import rank_threads, retry_failed_requested
from trnflow.results import TrialResult
from trnflow.specs import JobSpec
from trnflow.workload import watchdog
from trnflow.workload.context import WorkerContext
from trnflow.workload.programs import TRIAL_STEPS, for_trial, programs_of
from trnflow.workload.recipes import for_job, plan_digest

LOCK_WAIT_SECONDS = 3600.0
LOCK_POLL_SECONDS = 0.5


@dataclass
class Planned:
    program: str
    graph: Any
    """The traced graph: its `data_shapes` and `canonical()` text."""
    key: str

    @property
    def entry(self) -> str:
        return entry_name(self.key)


def extract(spec: JobSpec, device: Device | None = None) -> list[Planned]:
    """Every distinct graph of the spec's programs, found by a trial run in extraction mode:
    a few training steps, one evaluation batch and one embedding batch, all run eagerly."""
    device = device or get_device(choose(spec).name)
    recipe = for_job(spec)
    compiler = device.compiler(spec, mode="extract", model=recipe.key)
    for program in programs_of(spec):
        for_trial(spec, recipe, compiler, device, program).exercise(program, steps=TRIAL_STEPS)
    planned: dict[str, Planned] = {}
    for seen in compiler.seen:
        planned.setdefault(seen.key, Planned(seen.program, seen.graph, seen.key))
    torch._dynamo.reset()
    return list(planned.values())


def _threads(spec: JobSpec) -> int:
    """The host threads each rank of the run will use. Inductor's CPU kernels specialise on the thread
    count, and its cache keys include it, so the compile must use the run's."""
    return spec.compute.threads_per_core or rank_threads(spec.compute.world_size)


def compile_one(spec_json: str, program: str, key: str, retry_failed: bool = False) -> ProgramOutcome:
    """One graph's compilation, in its own process (see `compile_program`)."""
    (outcome,) = compile_program(spec_json, program, [key], retry_failed)
    return outcome


def _lock(cache: CompileCache, entry: str, deadline: float) -> bool | EntryLocked:
    """Take an entry's lock, waiting until `deadline` (monotonic) while another process holds it:
    whether a stale lock was cleared, or the holder that never let go."""
    while True:
        try:
            return cache.acquire_lock(entry)
        except EntryLocked as exc:
            if time.monotonic() > deadline:
                return exc
            time.sleep(LOCK_POLL_SECONDS)


def compile_program(spec_json: str, program: str, keys: list[str], retry_failed: bool = False,
                    library: str | None = None) -> list[ProgramOutcome]:
    """One program's missing graphs, in one process of their own: lock their entries, run the
    program once, commit each graph or record its failure. `library`: a folder of the compile job's
    own where each program leaves what the job's later programs may reuse (`Device.keep_built`).

    A program can have several graphs (a lazy device traces its first training steps apart), and
    running it compiles all of them, so they are compiled together rather than once per graph.
    Entries are locked in name order, so two compiles of overlapping graphs never wait on each
    other in a circle. An entry another process is compiling is waited for; if that process
    finished it, this one reports a hit for it."""
    spec = JobSpec.model_validate_json(spec_json)
    device = get_device(choose(spec).name)
    cache = plans.job_cache(spec)
    began, deadline = time.perf_counter(), time.monotonic() + LOCK_WAIT_SECONDS  # one wait for all the locks
    outcomes: dict[str, ProgramOutcome] = {}
    held: dict[str, bool] = {}  # key -> a stale lock was cleared
    try:
        for key in sorted(keys, key=entry_name):
            entry = entry_name(key)
            taken = _lock(cache, entry, deadline)
            if isinstance(taken, EntryLocked):
                outcomes[key] = ProgramOutcome(program=program, key=key, status="locked", owner=taken.owner)
                continue
            held[key] = taken
            state = cache.state(entry)  # under the lock: someone may have finished it meanwhile
            if state == states.DONE:
                outcomes[key] = ProgramOutcome(program=program, key=key, status="hit", waited=True)
            elif state == states.FAILED and not retry_failed:
                outcomes[key] = ProgramOutcome(program=program, key=key, status="failed", cached_failure=True)
        todo = [key for key in keys if key not in outcomes]
        if todo:
            outcomes |= _compile_graphs(spec, device, cache, program, todo, held, began,
                                        Path(library) if library else None)
    finally:
        for key in held:
            cache.release_lock(entry_name(key))
    return [outcomes[key] for key in keys]


def _compile_graphs(spec: JobSpec, device: Device, cache: CompileCache, program: str, keys: list[str],
                    stale: dict[str, bool], began: float, library: Path | None = None
                    ) -> dict[str, ProgramOutcome]:
    """Run `program` once in compile mode and file each of `keys` (their locks held). An error in the
    run fails them all; a graph the run did not trace fails alone (the program is not deterministic)."""
    for key in keys:
        cache.discard(entry_name(key))
    torch.set_num_threads(_threads(spec))
    with tempfile.TemporaryDirectory(prefix="trnflow-compile-") as tmp:
        workdir = Path(tmp)
        if library is not None:
            device.reuse_built(library, workdir)
        recipe = for_job(spec)
        compiler = device.compiler(spec, mode="compile", workdir=workdir, model=recipe.key)
        flags, texts = compiler.flags, {}
        try:
            # a lazy device meets step 2's graphs only there
            for_trial(spec, recipe, compiler, device, program).exercise(program, steps=TRIAL_STEPS)
            texts = {s.key: s.graph.canonical() for s in compiler.seen}
            artifact = device.artifact(workdir)
        except Exception:
            failures = dict.fromkeys(keys, traceback.format_exc())
        else:
            failures = {key: f"{program} traced to {sorted(texts)}, not {key}: the program's graph is not "
                             "deterministic\n" for key in keys if key not in texts}
            if library is not None:
                device.keep_built(workdir, library)
    compiled = [key for key in keys if key not in failures]
    seconds = round((time.perf_counter() - began) / len(keys), 3)  # one run for them all: each its share
    for key in compiled:
        cache.commit(entry_name(key), texts[key], flags, artifact, seconds)
    for key, failure in failures.items():
        cache.record_failure(entry_name(key), texts.get(key, ""), flags, failure)
    return {key: ProgramOutcome(program=program, key=key, status="failed", seconds=seconds) if key in failures else
            ProgramOutcome(program=program, key=key, status="done", seconds=seconds, together=len(compiled),
                           stale_lock_cleared=stale[key]) for key in keys}


def _counts(report: dict[str, ProgramOutcome], total: int) -> str:
    statuses = [r.status for r in report.values()]
    return CompileProgress.counting(done=sum(s in ("done", "hit") for s in statuses), failed=statuses.count("failed"),
                                    locked=statuses.count("locked"), total=total).line()


def _pool_context(spec: JobSpec, device: Device) -> multiprocessing.context.BaseContext:
    """How compile workers start: each is a fresh process (one program each, so a compiler that
    crashes or leaks takes no other program with it), forked from a server that imported torch, this
    module and the device's compiler once. Spawning each worker afresh cost its imports every time:
    about 5 CPU-seconds a worker, more than a small graph takes to compile. The server is one per
    process and starts with its first pool (a compile job has one), so workers see the environment
    as it is then, as spawned ones would. The recipe's own libraries come too (`Recipe.preloads`:
    transformers cost each worker about 1.4 CPU-s)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__, *device.compile_imports(spec), *for_job(spec).preloads])
    return context


def trial(spec: JobSpec, device: Device) -> TrialResult:
    """The trial steps alone, for the SDK's parallel compiler to wrap: every program on inputs of the
    run's shapes, nothing recorded or saved (the wrapper extracts and compiles the graphs)."""
    recipe = for_job(spec)
    compiler = device.compiler(spec, mode="trial", model=recipe.key)
    for program in programs_of(spec):
        for_trial(spec, recipe, compiler, device, program).exercise(program, steps=TRIAL_STEPS)
    return TrialResult(programs=list(programs_of(spec)), steps=TRIAL_STEPS)


def precompile(spec: JobSpec, device: Device) -> ParallelCompile | None:
    """The device's own parallel compiler over the trial (`compile --options '{"trial": true}'` in a
    process of its own), where the device has one here."""
    with tempfile.TemporaryDirectory(prefix="trnflow-trial-") as tmp:
        folder = Path(tmp)
        (folder / "spec.json").write_text(spec.model_dump_json())
        (folder / "options.json").write_text(json.dumps({"trial": True}))
        command = [sys.executable, "-m", "trnflow.workload", "compile", "--spec", str(folder / "spec.json"),
                   "--options", str(folder / "options.json"), "--output", str(folder / "output")]
        return device.precompile(spec, command)


def run(ctx: WorkerContext) -> dict | TrialResult:
    spec = ctx.spec
    assert spec is not None
    if ctx.options.get("trial"):
        return trial(spec, ctx.device)
    cache = plans.job_cache(spec)
    retry_failed = bool(ctx.options.get("retry_failed")) or retry_failed_requested()
    print(f"INFO ||NEURON_CACHE||: Compile cache path: {cache.url}", flush=True)
    with watchdog.busy("neuron_parallel_compile"):  # the compiler runs in processes of its own
        parallel = None if ctx.options.get("check") else precompile(spec, ctx.device)
    if parallel is not None:
        ctx.log("parallel_compile", **parallel.model_dump(exclude_none=True))
    plan, flags = extract(spec, ctx.device), ctx.device.compiler(spec, mode="extract", model=for_job(spec).key).flags
    prediction = plans.predict([ProgramPlan(program=p.program, key=p.key, shapes=p.graph.data_shapes) for p in plan],
                               cache, retry_failed, deep=True)
    plans.record(cache, plan_digest(spec), prediction)
    for row in prediction:
        print(f"INFO ||NEURON_CC_WRAPPER||: {row.program}: {row.key} is {row.state}; will {row.will}", flush=True)
    result = {"programs": prediction, "graphs": len(plan), "flags": flags, "compiler": COMPILER_VERSION,
              "cache": cache.url, **({"parallel_compile": parallel} if parallel else {})}
    if ctx.options.get("check"):
        return {**result, "check": True, "hits": sum(r.will == "hit" for r in prediction),
                "misses": sum(r.will != "hit" for r in prediction)}

    report: dict[str, ProgramOutcome] = {}
    todo = []
    for p, row in zip(plan, prediction, strict=True):
        if row.state == states.CORRUPT:
            print(f"WARNING ||NEURON_CACHE||: {cache.url}/{p.entry} is corrupt (checksum mismatch); "
                  "compiling it again", flush=True)
        if row.will == "hit":
            cache.record_hit(p.entry)
            report[p.key] = ProgramOutcome(program=p.program, key=p.key, status="hit")
        elif (row.will or "").startswith("skip"):
            print(f"INFO ||NCC_WRAPPER||: Got a cached failed neff at {cache.url}/{p.entry}. Will skip compilation, "
                  "please set --retry-failed for recompilation.", flush=True)
            report[p.key] = ProgramOutcome(program=p.program, key=p.key, status="failed", cached_failure=True)
        else:
            todo.append(p)
    print(_counts(report, len(plan)), flush=True)
    if todo:
        print("INFO ||NEURON_PARALLEL_COMPILE||: master grab graphs to compile: "
              f"{[f'{cache.url}/{p.entry}/model.fx.txt' for p in todo]}", flush=True)
        by_program: dict[str, list[str]] = {}
        for p in todo:
            by_program.setdefault(p.program, []).append(p.key)
        with watchdog.busy(f"compiling {len(todo)} graph(s)"), tempfile.TemporaryDirectory(
                prefix="trnflow-built-") as library, ProcessPoolExecutor(
                min(spec.compile.workers, len(by_program)), mp_context=_pool_context(spec, ctx.device),
                max_tasks_per_child=1) as pool:
            futures = [pool.submit(compile_program, spec.model_dump_json(), program, keys, retry_failed, library)
                       for program, keys in by_program.items()]
            for future in as_completed(futures):
                for outcome in future.result():
                    report[outcome.key] = outcome
                    ctx.log("compiled", **outcome.model_dump(include={"program", "key", "status", "seconds"}))
                print(_counts(report, len(plan)), flush=True)
    return _summarise(result, report, cache)


def _summarise(result: dict, report: dict[str, ProgramOutcome], cache: CompileCache) -> dict:
    statuses = ("hit", "done", "failed", "locked")
    summary = {"compilation_summary": {s: sum(r.status == s for r in report.values()) for s in statuses},
               "compilation_report": {k: r.model_dump(mode="json", exclude_defaults=True) for k, r in report.items()}}
    print(f"INFO ||NEURON_PARALLEL_COMPILE||: {json.dumps(summary)}", flush=True)
    print(f"INFO ||NEURON_PARALLEL_COMPILE||: Total graphs: {len(report)}", flush=True)
    print(f"INFO ||NEURON_PARALLEL_COMPILE||: Total successful compilations: "
          f"{summary['compilation_summary']['done']}", flush=True)
    print(f"INFO ||NEURON_PARALLEL_COMPILE||: Total failed compilations: "
          f"{summary['compilation_summary']['failed']}", flush=True)
    unfinished = [r for r in report.values() if r.status in ("failed", "locked")]
    if unfinished:
        names = ", ".join(f"{r.program} ({r.key}: {r.status})" for r in unfinished)
        if all(r.cached_failure for r in unfinished):
            hint = "it failed before and is not retried; fix the cause, then run `trnflow compile SPEC --retry-failed`"
        elif any(r.status == "locked" for r in unfinished):
            hint = "another process held its lock for too long; check for a hung compile, then run again"
        else:
            hint = f"see model.log in those entries under {cache.url}"
        raise FatalError(f"compilation failed for {names}: {hint}")
    counts = summary["compilation_summary"]
    return {**result, "hits": counts["hit"], "compiled": counts["done"], "report": report,
            "seconds": round(sum(r.seconds for r in report.values()), 3)}
