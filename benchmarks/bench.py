"""`make bench`: every benchmark in turn, one results JSON, one plot per benchmark and a table of
ratios against the baselines, under `runs/bench/`.

Each benchmark runs as its own process (as a user would run it), its output kept in
`runs/bench/<name>.log`; its last line of JSON (the shape `_report` gives it) is gathered into
`runs/bench/results.json` with the machine, the versions and the date. The XLA benchmark runs in
the XLA lane's environment (`.venv/xla`) when it exists, and is listed as skipped otherwise.

    python benchmarks/bench.py [--only NAME ...] [--out runs/bench]

With --only, the named benchmarks run again and replace their own entries in an existing
results.json; the others' stay, each with the date it was measured (`measured`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trnflow.fsutil import atomic_write_text

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
XLA_PYTHON = ROOT / ".venv" / "xla" / "bin" / "python"
BENCHMARKS = ("backend_overhead", "train_throughput", "sharded_train", "inference_throughput", "collectives",
              "compile_cache", "optlevels", "precision", "scale_cache", "scale_topology", "scale_inference",
              "scale_data", "xla_overhead", "lora", "lm", "tensor_parallel", "forecast", "fleet", "goodput")


def machine() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal"))
        memory_gib = round(mem / 1024**2, 1)
    except (OSError, StopIteration):
        memory_gib = None
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": memory_gib, "platform": platform.platform()}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for package in ("trnflow", "torch", "prefect", "numpy", "pyarrow"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def run_one(name: str, out: Path) -> dict:
    """One benchmark as its own process; its last JSON line, or why there is none."""
    python, env = sys.executable, dict(os.environ)
    if name == "xla_overhead":
        if not XLA_PYTHON.exists():
            return {"benchmark": name, "skipped": "no XLA lane environment (.venv/xla): run `make test-xla` once"}
        python, env = str(XLA_PYTHON), {**env, "PJRT_DEVICE": "CPU"}
    log = out / f"{name}.log"
    began, lines = time.perf_counter(), []
    with log.open("w") as sink, subprocess.Popen([python, "-u", str(HERE / f"{name}.py")], cwd=HERE, env=env,
                                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                 text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:  # shown as it comes (a benchmark can take minutes) and kept in its log
            sink.write(line)
            lines.append(line.rstrip("\n"))
            if not line.startswith("{"):
                print(f"  | {line}", end="", flush=True)
    seconds = round(time.perf_counter() - began, 1)
    last = next((line for line in reversed(lines) if line.startswith("{")), None)
    if proc.returncode != 0 or last is None:
        return {"benchmark": name, "failed": f"exit {proc.returncode}; see {log}", "seconds": seconds}
    return {**json.loads(last), "benchmark": name, "seconds": seconds}


def rows(results: list[dict]) -> list[tuple[str, ...]]:
    """The table: one row a figure (benchmark, figure, trnflow, baseline, comparison, goal, met)."""
    table = []
    for r in results:
        if "figures" not in r:
            table.append((r["benchmark"], r.get("skipped") or r.get("failed", "no figures"), "", "", "", "", ""))
            continue
        for f in r["figures"]:
            ours, theirs = statistics.median(f["trnflow"]), statistics.median(f["baseline"])
            if f["kind"] in ("ratio", "limit"):
                s = f["ratio"]
                comparison = f"x{s['median']:.3f} [{s['low']:.3f}, {s['high']:.3f}]"
                goal = "" if f["goal"] is None else f"{'>=' if f['better'] == 'higher' else '<='} {f['goal']}"
            else:
                s = f["difference"]
                comparison = f"{s['mean']:+.4f} [{s['low']:+.4f}, {s['high']:+.4f}]"
                goal = "" if f["goal"] is None else f"|diff| <= {f['goal']}"
            met = {True: "yes", False: "NO", None: ""}[f["met"]]
            table.append((r["benchmark"], f["name"], f"{ours:.4g} {f['unit']}",
                          f"{theirs:.4g} ({f['baseline_name']})", comparison, goal, met))
    return table


def plot(result: dict, path: Path) -> None:
    """One picture per benchmark: each ratio figure's repeats, trnflow beside its baseline, in a
    panel of its own; the difference figures together in one panel, each paired difference's
    mean with its 95% interval and repeats, over the goal's band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = [f for f in result["figures"] if f["kind"] in ("ratio", "limit")]
    differences = [f for f in result["figures"] if f["kind"] == "difference"]
    panels = len(ratios) + (1 if differences else 0)
    width = 3.2 * len(ratios) + (1.1 * len(differences) + 2 if differences else 0) + 1
    fig, axes = plt.subplots(1, panels, figsize=(width, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3.2] * len(ratios) + ([1.1 * len(differences) + 2]
                                                                                  if differences else [])})
    for ax, f in zip(axes[0], ratios, strict=False):
        for x, values in enumerate((f["trnflow"], f["baseline"])):
            ax.bar(x, statistics.median(values), color=("#1f77b4", "#aaaaaa")[x], alpha=0.6)
            ax.scatter([x] * len(values), values, color="black", s=12, zorder=3)
        if f["kind"] == "limit":  # no baseline bar: the bound as a line
            ax.axhline(f["baseline"][0], color="#d62728", lw=1.2, ls="--")
        ax.set_xticks([0, 1], ["trnflow", _short(f["baseline_name"])], fontsize=8)
        ax.set_ylabel(f["unit"])
        ax.set_title(f"{_short(f['name'], 34)}\nx{f['ratio']['median']:.3f}", fontsize=9)
    if differences:
        ax = axes[0][-1]
        goals = {f["goal"] for f in differences if f["goal"] is not None}
        for goal in goals:
            ax.axhspan(-goal, goal, color="#2ca02c", alpha=0.15, label=f"goal: within ±{goal}")
        ax.axhline(0, color="#888888", lw=0.8)
        for x, f in enumerate(differences):
            s = f["difference"]
            diffs = [t - b for t, b in zip(f["trnflow"], f["baseline"], strict=True)]
            ax.errorbar([x], [s["mean"]], yerr=[[s["mean"] - s["low"]], [s["high"] - s["mean"]]], fmt="o",
                        color="#1f77b4" if f["goal"] is not None else "#ff7f0e", capsize=5)
            ax.scatter([x + 0.18] * len(diffs), diffs, color="black", s=8, zorder=3)
        ax.set_xticks(range(len(differences)), [_short(f["name"], 30) for f in differences], rotation=30,
                      ha="right", fontsize=7)
        ax.set_xlim(-0.6, len(differences) - 0.4)
        ax.set_ylabel(f"{differences[0]['unit']} minus {_short(differences[0]['baseline_name'])}")
        ax.set_title("paired differences, mean and 95% interval", fontsize=9)
        if goals:
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(result["benchmark"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(text: str, width: int = 18) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, help="Run only these benchmarks.")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="Where results and plots go.")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    document = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "machine": machine(),
                "versions": versions(), "benchmarks": {}}
    if args.only and path.exists():  # the others' figures stay, each with the date it was measured
        document["benchmarks"] = json.loads(path.read_text()).get("benchmarks", {})
    ran = args.only or BENCHMARKS
    for name in ran:
        print(f"running {name} ...", flush=True)
        result = run_one(name, args.out) | {"measured": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
        if "figures" in result:
            plot(result, args.out / f"{name}.png")
        print(f"  {name}: {result.get('skipped') or result.get('failed') or 'done'} ({result.get('seconds', 0)} s)",
              flush=True)
        document["benchmarks"][name] = result
        # written after each benchmark: a run stopped part of the way keeps what it measured
        atomic_write_text(path, json.dumps(document, indent=1))
    results = [document["benchmarks"][name] for name in BENCHMARKS if name in document["benchmarks"]]

    from rich.console import Console
    from rich.table import Table

    table = Table("benchmark", "figure", "trnflow", "baseline", "trnflow vs baseline [95% CI]", "goal", "met",
                  title=f"benchmarks on {document['machine']['cpu']}, {document['machine']['cpus']} CPUs")
    for row in rows(results):
        table.add_row(*row)
    Console(width=200).print(table)
    print(f"results: {path}; plots: {args.out}/<benchmark>.png")
    failed = [name for name in ran if "failed" in document["benchmarks"][name]]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
