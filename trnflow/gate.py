"""The accuracy-parity gate: a candidate's metric series against a reference series.

Metrics files (a previous run's, or another platform's such as a GPU run) are JSON:

    {"format": 1, "source": "gpu-p4d", "points": [{"step": 300, "accuracy": 0.7913, "loss": 0.45}, ...]}

Points are matched by step. Every matched point must be within `max_abs_diff` (the M5 rule: less
than 0.1% apart at every evaluation point).
"""

from __future__ import annotations

import json
from typing import Any

from trnflow.errors import DataError

FORMAT = 1


def metrics_document(points: list[dict[str, Any]], source: str) -> dict[str, Any]:
    return {"format": FORMAT, "source": source, "points": sorted(points, key=lambda p: p["step"])}


def parse_metrics(text: str, origin: str, metric: str) -> list[dict[str, Any]]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"{origin}: not JSON ({exc}); expected a trnflow metrics file") from None
    points = doc.get("points") if isinstance(doc, dict) else None
    if not isinstance(points, list) or not points:
        raise DataError(f'{origin}: expected {{"format": 1, "points": [{{"step": N, "{metric}": x}}, ...]}}')
    for i, p in enumerate(points):
        if not isinstance(p, dict) or not isinstance(p.get("step"), int) or not isinstance(p.get(metric), float | int):
            raise DataError(f"{origin}: points[{i}] needs an integer 'step' and a numeric '{metric}'")
    return points


def compare(candidate: list[dict], reference: list[dict], metric: str, max_abs_diff: float) -> dict[str, Any]:
    """The verdict: every matched point with both values, their difference and pass or fail."""
    ref_by_step = {p["step"]: p[metric] for p in reference}
    rows = []
    for point in sorted(candidate, key=lambda p: p["step"]):
        if point["step"] not in ref_by_step:
            continue
        ref = ref_by_step[point["step"]]
        diff = point[metric] - ref
        rows.append({"step": point["step"], "candidate": point[metric], "reference": ref,
                     "diff": diff, "passed": abs(diff) <= max_abs_diff})
    verdict: dict[str, Any] = {"metric": metric, "max_abs_diff": max_abs_diff, "points": rows}
    if not rows:
        verdict["passed"] = False
        verdict["reason"] = (
            f"no common evaluation step: candidate steps {[p['step'] for p in candidate]}, "
            f"reference steps {sorted(ref_by_step)}; evaluate both at the same steps"
        )
    else:
        failing = [r for r in rows if not r["passed"]]
        verdict["passed"] = not failing
        if failing:
            verdict["reason"] = "; ".join(
                f"step {r['step']}: {metric} {r['candidate']:.4f} vs reference {r['reference']:.4f} "
                f"(diff {r['diff']:+.4f}, allowed ±{max_abs_diff})" for r in failing
            )
    return verdict
