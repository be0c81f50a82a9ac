"""A compile cache of 10,000 entries: how long `trnflow cache ls` and a warm check take on it. Goals:
`cache ls` (the real command in a process of its own, so its start-up counts) under 2 s, and the warm
check of a spec's graphs under 1 s; both read the cache's listing, its index and the few small files
they need, never an artifact.

The cache is built in a temporary folder through `CompileCache`'s own writes (commits, hits, failures,
locks, discards) into a store that skips fsync, so that 10,000 entries take seconds: the files are the
ones every compile writes. A thousandth of the entries each is failed, locked, missing, truncated
(corrupt) and bit-flipped (done until verified), and half a percent are the Neuron compiler's own.

- `ls`: `trnflow cache ls URL` and `trnflow cache ls URL --json`, wall and CPU seconds. The first
  listing of a cache with no index reads every entry's record and usage and writes the index
  (reported on its own); a second one keeps the rows of the files written last (`SETTLE_SECONDS` in
  trnflow/device/cache.py); the figures are the medians of the repeats after that. `cache ls` of an
  empty cache is timed too: the command's start-up alone.
- the warm check: what the compile stage does before it launches anything (tasks/compile.py), in this
  process: the plan recorded under the quickstart spec's digest (here naming three of the cache's done
  entries) read from the cache, then each of its graphs' state.
- for context, `trnflow compile SPEC --check` once: it launches a compile job, which traces the model
  to find its graphs (seconds of torch, whatever the cache holds); `--no-compile-check` leaves it out.

    python benchmarks/scale_cache.py [--entries 10000] [--repeats 5] [--dir DIR] [--no-compile-check]

The last line printed is JSON (`_report`'s shape), with {"entries", "ls_s", "ls_cpu_s", "ls_json_s",
"ls_first_s", "startup_s", "startup_cpu_s", "ls_limit_s": 2, "check_s", "check_limit_s": 1,
"compile_check_s", "within"}. It exits 1 when `ls`, `ls --json` or the
check (medians, wall clock) is over its limit.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import os
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _quickstart import quickstart, scratch_home
from _report import emit, limit_figure

from trnflow.device import plans
from trnflow.device.cache import (
    CORRUPT,
    DONE,
    FAILED,
    LOCKED,
    MISSING,
    CompileCache,
    entry_name,
    module_key,
)
from trnflow.storage import LocalStore
from trnflow.workload.memory import decided
from trnflow.workload.programs import PROGRAMS
from trnflow.workload.recipes import plan_digest

NEURON_VERSION = "neuronxcc-2.15.128.0+56dc5a86"
"""A version folder as neuronx-cc names it, for the Neuron compiler's own entries."""
FLAGS = {"optlevel": 2, "precision": "fp32"}
LS_LIMIT_S, CHECK_LIMIT_S = 2.0, 1.0


class UnsyncedStore(LocalStore):
    """A directory store that writes each file in place with no fsync: `CompileCache` writes through it
    the very files it writes to any cache, 10,000 entries in seconds rather than minutes of syncs."""

    def __init__(self, root: Path):
        super().__init__(root)
        self._folders: set[str] = set()

    def _file(self, name: str) -> str:
        return os.path.join(self.root, name)

    def read(self, name: str) -> bytes:
        with open(self._file(name), "rb") as handle:
            return handle.read()

    def write(self, name: str, data: bytes) -> None:
        path = self._file(name)
        folder = os.path.dirname(path)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        with open(path, "wb") as handle:
            handle.write(data)

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(name))


@dataclass
class Built:
    """What `build_cache` wrote, by `<version folder>/<key>`."""

    states: dict[str, str] = field(default_factory=dict)
    """The state `trnflow cache ls` gives each entry."""
    verified: dict[str, str] = field(default_factory=dict)
    """The state `trnflow cache verify` gives each one (which reads the artifacts)."""
    hits: dict[str, int] = field(default_factory=dict)
    done: list[str] = field(default_factory=list)
    """trnflow's done entries, in the order they were written."""


def _artifact(size: int) -> bytes:
    """A small compiled artifact: a gzipped tar, as every artifact is."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("graph-01.py")
        payload = bytes(range(256)) * (size // 256 + 1)
        info.size = size
        tar.addfile(info, io.BytesIO(payload[:size]))
    return buffer.getvalue()


def build_cache(root: Path, entries: int) -> Built:
    """A cache of `entries` entries under `root`, written by `CompileCache` (see the module's docstring)."""
    cache = CompileCache(str(root), store=UnsyncedStore(root))
    artifacts = [_artifact(200 + 37 * n) for n in range(64)]
    built = Built()
    for i in range(entries):
        graph = f"graph {i}: def forward(x): return x @ w{i}\n"
        key = module_key(hashlib.sha256(graph.encode()).hexdigest()[:20], FLAGS)
        kind = i % 1000
        if kind >= 995:  # the Neuron compiler's own done entry
            folder = root / NEURON_VERSION / key
            folder.mkdir(parents=True)
            for name, data in (("model.hlo_module.pb", graph.encode()), ("model.neff", artifacts[i % 64]),
                               ("model.done", b"")):
                (folder / name).write_bytes(data)
            built.states[f"{NEURON_VERSION}/{key}"] = built.verified[f"{NEURON_VERSION}/{key}"] = DONE
            built.hits[f"{NEURON_VERSION}/{key}"] = 0
            continue
        entry = entry_name(key)
        hits = 0
        if kind == 1:
            cache.record_failure(entry, graph, FLAGS, "neuronx-cc: error: out of memory\n")
            state = deep = FAILED
        elif kind == 2:
            cache.acquire_lock(entry)  # held by this process, alive while the cache is listed
            state = deep = LOCKED
        else:
            cache.commit(entry, graph, FLAGS, artifacts[i % 64], seconds=1.5)
            state = deep = DONE
            if kind == 3:
                cache.discard(entry)
                state = deep = MISSING
            elif kind == 4:  # truncated: its size is not the recorded one
                cache.store.write(f"{entry}/model.neff", artifacts[i % 64][:-10])
                state = deep = CORRUPT
            elif kind == 5:  # one byte flipped: the size is right, the checksum is not
                flipped = bytearray(artifacts[i % 64])
                flipped[-1] ^= 0xFF
                cache.store.write(f"{entry}/model.neff", bytes(flipped))
                deep = CORRUPT
            else:
                built.done.append(entry)
                hits = i % 3
                for _ in range(hits):
                    cache.record_hit(entry)
        built.states[entry], built.verified[entry], built.hits[entry] = state, deep, hits
    return built


def _command() -> list[str]:
    """The `trnflow` command of this environment."""
    script = Path(sys.executable).with_name("trnflow")
    return [str(script)] if script.exists() else [sys.executable, "-m", "trnflow.cli"]


def timed_run(args: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds `trnflow ARGS` takes, start-up included; a failed command ends the benchmark."""
    before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run([*_command(), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took, after = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"trnflow {' '.join(args)} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return took, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _medians(runs: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(wall for wall, _ in runs), statistics.median(cpu for _, cpu in runs)


def warm_check(url: str, digest: str) -> tuple[float, list[dict]]:
    """The compile stage's check before it launches anything, as tasks/compile.py makes it: the plan
    recorded for the spec's digest, then each graph's state in the cache. Its seconds and its rows."""
    began = time.perf_counter()
    cache = CompileCache(url)
    known = plans.recorded(cache, digest)
    assert known is not None, "no plan recorded"
    prediction = plans.predict(known, cache, retry_failed=False)
    return time.perf_counter() - began, prediction


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="Where to build the cache (default: the system's "
                        "temporary folder).")
    parser.add_argument("--no-compile-check", dest="compile_check", action="store_false",
                        help="Leave out the `trnflow compile SPEC --check` run (it launches a job).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trnflow-bench-", dir=args.dir) as tmp:
        root = Path(tmp)
        scratch_home(root)
        url = str(root / "cache")
        began = time.perf_counter()
        built = build_cache(root / "cache", args.entries)
        build_s = time.perf_counter() - began
        print(f"built {len(built.states)} entries in {build_s:.1f}s")

        (root / "empty").mkdir()
        startup = [timed_run(["cache", "ls", str(root / "empty")]) for _ in range(args.repeats)]
        first, _ = timed_run(["cache", "ls", url])  # reads every entry's record and usage, writes the index
        timed_run(["cache", "ls", url])  # keeps the rows of the files written last
        ls = [timed_run(["cache", "ls", url]) for _ in range(args.repeats)]
        ls_json = [timed_run(["cache", "ls", url, "--json"]) for _ in range(args.repeats)]

        spec = quickstart(root, compile={"cache_url": url})
        digest = plan_digest(decided(spec))  # as a run decides its layout before it asks
        plans.record(CompileCache(url), digest, [{"program": program, "key": entry.split("/")[1], "shapes": ""}
                                                 for program, entry in zip(PROGRAMS, built.done, strict=False)])
        checks = [warm_check(url, digest) for _ in range(args.repeats)]
        assert all(row["will"] == "hit" for row in checks[-1][1]), checks[-1][1]

        compile_check = None
        if args.compile_check:
            spec_file = root / "spec.json"
            spec_file.write_text(spec.model_dump_json())
            compile_check, _ = timed_run(["compile", str(spec_file), "--check"])

    (ls_s, ls_cpu), (ls_json_s, _), (startup_s, startup_cpu) = _medians(ls), _medians(ls_json), _medians(startup)
    check_s = statistics.median(seconds for seconds, _ in checks)
    within = ls_s <= LS_LIMIT_S and ls_json_s <= LS_LIMIT_S and check_s <= CHECK_LIMIT_S
    print(f"{len(built.states)} entries: `cache ls` {ls_s:.2f}s ({ls_cpu:.2f}s of CPU), `cache ls --json` "
          f"{ls_json_s:.2f}s, medians of {args.repeats}; of an empty cache {startup_s:.2f}s ({startup_cpu:.2f}s "
          f"of CPU); the first listing, which writes the index, {first:.2f}s. Warm check of "
          f"{len(checks[-1][1])} graphs {check_s * 1000:.1f} ms"
          + (f"; `trnflow compile --check`, which launches a job, {compile_check:.1f}s" if compile_check else "")
          + f". {'Within' if within else 'Over'} the limits ({LS_LIMIT_S:g}s, {CHECK_LIMIT_S:g}s)")
    figures = [limit_figure(f"`cache ls`, {len(built.states):,} entries", [t for t, _ in ls], LS_LIMIT_S, unit="s"),
               limit_figure(f"`cache ls --json`, {len(built.states):,} entries", [t for t, _ in ls_json], LS_LIMIT_S,
                            unit="s"),
               limit_figure("warm check of a spec's graphs", [t for t, _ in checks], CHECK_LIMIT_S, unit="s")]
    emit("scale_cache", figures, **{"entries": len(built.states), "build_s": round(build_s, 2), "ls_s": round(ls_s, 3),
                      "ls_cpu_s": round(ls_cpu, 3), "ls_json_s": round(ls_json_s, 3), "ls_first_s": round(first, 3),
                      "startup_s": round(startup_s, 3), "startup_cpu_s": round(startup_cpu, 3),
                      "ls_limit_s": LS_LIMIT_S, "check_s": round(check_s, 4), "check_limit_s": CHECK_LIMIT_S,
                      "compile_check_s": None if compile_check is None else round(compile_check, 2),
                      "within": within})
    if not within:
        sys.exit(1)


if __name__ == "__main__":
    main()
