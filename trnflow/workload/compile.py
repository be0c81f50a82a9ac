"""The ahead-of-time compile phase, like neuron_parallel_compile: extract every program's graphs
(without training), look each key up in the persistent cache, and compile the misses in a pool
of `compile.workers` processes.

Options: `check` (only say which programs would hit or miss) and `retry_failed` (compile entries
that failed before, which are otherwise remembered and skipped).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import torch

from jobspecs import JobSpec
from trnflow.emulator import cache, compiler
from trnflow.errors import FatalError
from trnflow.storage import local_path
from trnflow.workload.context import WorkerContext
from trnflow.workload.model import build_model
from trnflow.workload.programs import programs

LOCK_WAIT_SECONDS = 600.0


@dataclass
class Planned:
    program: str
    graphs: list[compiler.Graph]
    key: str
    entry: Path

    @property
    def graph_text(self) -> str:
        return "\n".join(g.canonical() for g in self.graphs)


def extract(spec: JobSpec, root: Path) -> list[Planned]:
    """Every program's graphs and cache entry, found by tracing only (nothing is trained)."""
    flags = compiler.compile_flags(spec.compile.optlevel, spec.compute.precision)
    model = build_model(spec.model, spec.train.seed)
    planned: dict[str, Planned] = {}
    for program in programs(spec, model):
        program.prepare(model)
        with contextlib.nullcontext() if program.training else torch.no_grad():
            graphs = compiler.capture_graphs(program.fn, *program.example)
        key = compiler.cache_key(graphs, flags)
        planned.setdefault(key, Planned(program.name, graphs, key, compiler.entry_dir(root, key)))
    return list(planned.values())


def compile_one(spec_json: str, program: str, entry: str, flags: dict, graph_text: str) -> dict:
    """One compilation, in its own process: lock the entry, compile, commit or record the failure."""
    entry_path, began = Path(entry), time.perf_counter()
    torch.set_num_threads(1)
    try:
        stale = cache.acquire_lock(entry_path)
    except cache.EntryLocked as exc:
        return {"program": program, "key": entry_path.name, "status": "locked", "owner": exc.owner, "seconds": 0.0}
    status = "done"
    try:
        spec = JobSpec.model_validate_json(spec_json)
        model = build_model(spec.model, spec.train.seed)
        prog = next(p for p in programs(spec, model) if p.name == program)
        prog.prepare(model)
        with tempfile.TemporaryDirectory(prefix="trnflow-inductor-") as tmp:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tmp
            compiled = compiler.compiled_fn(prog.fn, flags, Path(tmp))
            if prog.training:
                compiled(*prog.example).backward()
            else:
                with torch.no_grad():
                    compiled(*prog.example)
            artifact = compiler.pack_dir(Path(tmp))
        cache.commit(entry_path, graph_text, flags, artifact)
    except Exception:
        status = "failed"
        cache.record_failure(entry_path, graph_text, flags, traceback.format_exc())
    finally:
        cache.release_lock(entry_path)
    return {"program": program, "key": entry_path.name, "status": status, "retries": 0,
            "seconds": round(time.perf_counter() - began, 3), "stale_lock_cleared": stale}


def _counts(report: dict[str, dict], total: int) -> str:
    done = sum(r["status"] in ("done", "hit") for r in report.values())
    failed = sum(r["status"] == "failed" for r in report.values())
    locked = sum(r["status"] == "locked" for r in report.values())
    remaining = total - done - failed - locked
    return (f"INFO ||NEURON_CACHE||: Current remaining items are {remaining}, locked are {locked}, "
            f"failed are {failed}, done are {done}, total is {total}")


def _wait_for_other_compiler(entry: Path) -> str:
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while cache.state(entry) == cache.LOCKED and time.monotonic() < deadline:
        time.sleep(0.5)
    return cache.state(entry)


def run(ctx: WorkerContext) -> dict:
    spec = ctx.spec
    assert spec is not None
    root = local_path(spec.compile.cache_url)
    flags = compiler.compile_flags(spec.compile.optlevel, spec.compute.precision)
    print(f"INFO ||NEURON_CACHE||: Compile cache path: {root}", flush=True)
    plan = extract(spec, root)
    states = {p.key: cache.state(p.entry) for p in plan}
    retry_failed = bool(ctx.options.get("retry_failed"))
    prediction = [{"program": p.program, "key": p.key, "state": states[p.key],
                   "will": "hit" if states[p.key] == cache.DONE
                   else "skip (failed before)" if states[p.key] == cache.FAILED and not retry_failed
                   else "compile"} for p in plan]
    for row in prediction:
        print(f"INFO ||NEURON_CC_WRAPPER||: {row['program']}: {row['key']} is {row['state']}; will {row['will']}",
              flush=True)
    result = {"programs": prediction, "graphs": sum(len(p.graphs) for p in plan), "flags": flags,
              "compiler": compiler.COMPILER_VERSION, "cache": root.as_uri()}
    if ctx.options.get("check"):
        return {**result, "check": True, "hits": sum(r["will"] == "hit" for r in prediction),
                "misses": sum(r["will"] != "hit" for r in prediction)}

    report: dict[str, dict] = {}
    todo = []
    for p in plan:
        state = states[p.key]
        if state == cache.LOCKED:
            state = _wait_for_other_compiler(p.entry)
        if state == cache.CORRUPT:
            print(f"WARNING ||NEURON_CACHE||: {p.entry} is corrupt (checksum mismatch); compiling it again",
                  flush=True)
        if state == cache.DONE:
            cache.record_hit(p.entry)
            report[p.key] = {"program": p.program, "key": p.key, "status": "hit", "seconds": 0.0, "retries": 0}
        elif state == cache.FAILED and not retry_failed:
            report[p.key] = {"program": p.program, "key": p.key, "status": "failed", "seconds": 0.0,
                             "retries": 0, "cached_failure": True}
        else:
            cache.discard(p.entry)
            todo.append(p)
    print(_counts(report, len(plan)), flush=True)
    if todo:
        print("INFO ||NEURON_PARALLEL_COMPILE||: master grab hlos to compile: "
              f"{[str(p.entry / 'model.fx.txt') for p in todo]}", flush=True)
        workers = min(spec.compile.workers, len(todo))
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=spawn, max_tasks_per_child=1) as pool:
            futures = [pool.submit(compile_one, spec.model_dump_json(), p.program, str(p.entry), flags, p.graph_text)
                       for p in todo]
            for future in as_completed(futures):
                outcome = future.result()
                report[outcome["key"]] = outcome
                print(_counts(report, len(plan)), flush=True)
    summary = {"compilation_summary": {status: sum(r["status"] == status for r in report.values())
                                       for status in ("hit", "done", "failed", "locked")},
               "compilation_report": report}
    print(f"INFO ||NEURON_PARALLEL_COMPILE||: {json.dumps(summary)}", flush=True)
    failed = [r for r in report.values() if r["status"] == "failed"]
    if failed:
        names = ", ".join(f"{r['program']} ({r.get('key')})" for r in failed)
        hint = ("it failed before and is not retried; fix the cause, then run `trnflow compile SPEC --retry-failed`"
                if all(r.get("cached_failure") for r in failed) else f"see model.log under {root}")
        raise FatalError(f"compilation failed for {names}: {hint}")
    return {**result, "hits": summary["compilation_summary"]["hit"],
            "compiled": summary["compilation_summary"]["done"], "report": report,
            "seconds": round(sum(r["seconds"] for r in report.values()), 3)}
