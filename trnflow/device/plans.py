"""Knowing before launch: the graphs a spec needs, as its last trial run found them.

Extracting graphs means building the model and tracing it in a job. Once a compile job has done
that, it records the plan (each program's key and input shapes) in the cache, named by a digest of
everything that decides the graphs: the model section, the device, the batch shapes, precision and optlevel,
the compiler version, and the source of the code that builds and traces the programs. The next
compile stage for an equal digest knows every key without launching anything, so a warm stage
costs a few cache reads. A plan that went stale anyway is no silent failure: the run's
recompilation guard reports any graph missing from the cache.

Nothing here imports torch, so the orchestrator can answer quickly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from urllib.parse import unquote, urlparse

from pydantic import ValidationError

from trnflow.device import cache as states
from trnflow.device.cache import COMPILER_VERSION, CompileCache, entry_name, folder_problem
from trnflow.device.signing import UNSIGNED_ENV, EntryKeys, keys_from, shared_cache_problem
from trnflow.errors import FatalError
from trnflow.measures import ProgramPlan
from trnflow.neuron.launch import cache_url
from trnflow.specs import JobSpec

log = logging.getLogger("trnflow.device")

_ROOT = Path(__file__).resolve().parents[1]
GRAPH_SOURCES = ("workload/programs.py", "workload/packing.py", "emulator/compiler.py", "emulator/jit.py",
                 "device/indexed.py", "device/xla.py", "device/neuron.py")
"""trnflow's files that shape the graphs; the recipe's own files come from its caller."""


def plan_digest(spec: JobSpec, model: str, model_sources: list[Path]) -> str:
    """What decides a spec's graphs: the model (`model`, the recipe's `name@version`, its params and
    its source files), the shapes, precision, optimisation level, compiler and trnflow's own files."""
    sources = {name: hashlib.sha256((_ROOT / name).read_bytes()).hexdigest() for name in GRAPH_SOURCES}
    sources |= {f"model/{path.name}": hashlib.sha256(path.read_bytes()).hexdigest() for path in model_sources}
    shaping = {
        "model": spec.model.model_dump(mode="json"),
        "recipe": model,
        "device": spec.compute.device,
        "per_core_batch": spec.per_core_batch,
        "packing": spec.data.packing,  # the training program's windows
        "inference_batch": spec.inference.batch_size,
        "precision": spec.compute.precision,
        # a sharded or split model's training programs are others (a run's flow decides `auto` first)
        "layout": spec.layout.model_dump(mode="json"),
        "optlevel": spec.compile.optlevel,
        "compiler": COMPILER_VERSION,
        "sources": sources,
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:24]


def _name(digest: str) -> str:
    return f"{COMPILER_VERSION}/plans/{digest}.json"


def record(cache: CompileCache, digest: str, programs: list[ProgramPlan]) -> None:
    """Remember which program has which key and shapes (from a trial run)."""
    rows = [p.model_dump(include={"program", "key", "shapes"}) for p in programs]
    cache.store.write(_name(digest), json.dumps({"programs": rows}, indent=2).encode())


def recorded(cache: CompileCache, digest: str) -> list[ProgramPlan] | None:
    """The plan a trial run recorded for an equal spec (`plan_digest`), or None (none, or not one
    this trnflow can read: the compile job then finds the plan again)."""
    try:
        rows = json.loads(cache.store.read(_name(digest)))["programs"]
        return [ProgramPlan.model_validate(row) for row in rows]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValidationError):
        return None


def predict(programs: list[ProgramPlan], cache: CompileCache, retry_failed: bool, deep: bool = False
            ) -> list[ProgramPlan]:
    """For each graph: its cache state and what compiling would do (hit, compile, skip or wait). The
    state comes from metadata alone unless `deep` (a compile job checks the artifacts it relies on;
    a warm check before launch does not read them, and a run still verifies what it loads)."""
    rows = []
    for p in programs:
        state = cache.state(entry_name(p.key), deep=deep)
        will = ("hit" if state == states.DONE
                else "skip (failed before)" if state == states.FAILED and not retry_failed
                else "wait (being compiled)" if state == states.LOCKED
                else "compile")
        rows.append(p.model_copy(update={"state": state, "will": will}))
    return rows


def cache_problem(spec: JobSpec) -> str | None:
    """Why the spec's local compile cache folder cannot be trusted (`folder_problem`), or None."""
    url = spec.compile.cache_url
    problem = folder_problem(Path(unquote(urlparse(url).path))) if url.startswith("file://") else None
    return (f"compile.cache_url {url}: {problem}; what a cache holds runs in every job that loads it, so use a "
            "folder of your own (the default, under $XDG_CACHE_HOME or ~/.cache)") if problem else None


def job_cache(spec: JobSpec, env: dict[str, str] | None = None, keys: EntryKeys | None = None) -> CompileCache:
    """The cache a job of `spec` compiles into and loads from, found as Neuron's compiler wrapper
    finds it: `--cache_dir` in NEURON_CC_FLAGS, then NEURON_COMPILE_CACHE_URL, then
    `compile.cache_url` (`trnflow.neuron.launch.cache_url`). Every job, and the stage that predicts
    their hits before launch, opens it here, so they all mean the same cache. `env`: the environment
    to resolve it in (default: this process's). The keys entries are signed and checked with are
    `keys`, else this process's (`trnflow.device.signing`). A shared cache nothing checks is refused
    (`shared_cache_problem`): FatalError, never retried."""
    url, keys = cache_url(spec.compile.cache_url, env), keys or keys_from()
    if problem := shared_cache_problem(url, keys.checks, keys.unsigned_ok):
        raise FatalError(problem)  # fails closed in every job, whatever launched it
    if url.startswith("s3://") and not keys.checks:
        log.warning("compile cache %s: entries are neither signed nor checked (%s)", url, UNSIGNED_ENV)
    return CompileCache(url, keys=keys)
