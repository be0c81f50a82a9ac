"""The one shape every benchmark's last line of JSON takes, so `make bench` can tabulate and plot them.

A benchmark reports one or more figures. Each figure holds every repeat of trnflow's measurement
and of the fair baseline measured beside it in the same run, and how they compare:

- kind `ratio`: trnflow / baseline per repeat (pairs measured back to back), with its mean and 95%
  interval; `better` says whether a higher or lower ratio is better, `goal` is the bound to meet;
- kind `difference`: trnflow - baseline per repeat (paired, e.g. the same seed), with its interval;
  `goal` is the largest |mean difference| that counts as equal;
- kind `limit`: a scale figure against a fixed bound rather than a baseline (seconds to list 10,000
  cache entries, say); `ratio` is the median over the limit, met at 1 or below.

    {"benchmark": "train_throughput", "figures": [{"name": ..., "kind": "ratio", "unit": "samples/s",
     "trnflow": [...], "baseline": [...], "baseline_name": ..., "better": "higher", "goal": 0.95,
     "ratio": {"mean": ..., "low": ..., "high": ..., ...}, "met": true}], ...details}
"""

from __future__ import annotations

import json
import statistics

from _stats import interval, paired, ratio_interval


def _spread(values: list[float]) -> dict:
    """An interval where there are two values or more; a single value stands alone."""
    if len(values) >= 2:
        return interval(values)
    v = float(values[0])
    return {"mean": v, "low": v, "high": v, "sd": 0.0, "n": 1, "values": [v]}


def ratio_figure(name: str, trnflow: list[float], baseline: list[float], *, unit: str, baseline_name: str,
                 better: str = "higher", goal: float | None = None) -> dict:
    """trnflow against its baseline as a ratio of paired repeats; `met` compares the median ratio with `goal`."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', not {better!r}")
    ratios = [t / b for t, b in zip(trnflow, baseline, strict=True)]
    stat = ratio_interval(trnflow, baseline) if len(ratios) >= 2 else _spread(ratios)
    median = statistics.median(ratios)
    met = None if goal is None else (median >= goal if better == "higher" else median <= goal)
    return {"name": name, "kind": "ratio", "unit": unit, "trnflow": list(trnflow), "baseline": list(baseline),
            "baseline_name": baseline_name, "better": better, "goal": goal, "ratio": {**stat, "median": median},
            "met": met}


def difference_figure(name: str, trnflow: list[float], baseline: list[float], *, unit: str, baseline_name: str,
                      goal: float | None = None) -> dict:
    """trnflow minus its baseline over paired repeats; `met` when the mean difference is within ±`goal`."""
    stat = paired(trnflow, baseline) if len(trnflow) >= 2 else _spread([trnflow[0] - baseline[0]])
    met = None if goal is None else abs(stat["mean"]) <= goal
    return {"name": name, "kind": "difference", "unit": unit, "trnflow": list(trnflow), "baseline": list(baseline),
            "baseline_name": baseline_name, "goal": goal, "difference": stat, "met": met}


def limit_figure(name: str, trnflow: list[float], limit: float, *, unit: str) -> dict:
    """A measured figure (lower is better) against a fixed `limit`; met when its median is within it."""
    median = statistics.median(trnflow)
    return {"name": name, "kind": "limit", "unit": unit, "trnflow": list(trnflow), "baseline": [limit],
            "baseline_name": "limit", "better": "lower", "goal": 1.0,
            "ratio": {**_spread([t / limit for t in trnflow]), "median": median / limit}, "met": median <= limit}


def emit(benchmark: str, figures: list[dict], **details: object) -> None:
    """Print the benchmark's last line: its figures and whatever else it measured."""
    print(json.dumps({"benchmark": benchmark, "figures": figures, **details}))
