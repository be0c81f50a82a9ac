"""Means with 95% confidence intervals (Student's t), for figures measured a few times each."""

from __future__ import annotations

import math
import statistics

# Two-sided 95% quantiles of Student's t by degrees of freedom; above 30 the normal's 1.96 is close enough.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    if df < 1:
        raise ValueError("a confidence interval needs at least two values")
    if df in _T975:
        return _T975[df]
    below = [d for d in _T975 if d <= df]
    return _T975[max(below)] if df <= 30 else 1.96


def interval(values: list[float]) -> dict:
    """Mean, 95% interval and standard deviation of `values` (at least two), with the values themselves."""
    values = [float(v) for v in values]
    mean = statistics.fmean(values)
    sd = statistics.stdev(values)
    half = t975(len(values) - 1) * sd / math.sqrt(len(values))
    return {"mean": mean, "low": mean - half, "high": mean + half, "sd": sd, "n": len(values), "values": values}


def paired(values: list[float], baseline: list[float]) -> dict:
    """The interval of the differences `values[i] - baseline[i]` (same seed, same data, so shared noise cancels)."""
    if len(values) != len(baseline):
        raise ValueError(f"paired values differ in number: {len(values)} and {len(baseline)}")
    return interval([v - b for v, b in zip(values, baseline, strict=True)])


def ratio_interval(ours: list[float], theirs: list[float]) -> dict:
    """The interval of per-repeat ratios ours[i] / theirs[i] (each pair measured back to back)."""
    return interval([o / t for o, t in zip(ours, theirs, strict=True)])


def show(stat: dict, scale: float = 1.0, digits: int = 2) -> str:
    """`mean [low, high]`, each times `scale`."""
    f = f"{{:.{digits}f}}"
    return f"{f.format(stat['mean'] * scale)} [{f.format(stat['low'] * scale)}, {f.format(stat['high'] * scale)}]"
