"""The accuracy-parity gate: a candidate's metric series against a reference series.

A metrics file (a trnflow run's `metrics.json`, or another platform's, such as a GPU run's) is JSON:

    {"format": 1, "source": "gpu-p4d",
     "points": [{"step": 300, "accuracy": 0.7913, "loss": 0.45}, ...],
     "holdout_sha256": "...",                                  optional
     "predictions": {"step": 300, "correct": "0110..."}}       optional

Points are matched by step. In `every-point` mode every matched point must be within the band
(`max_abs_diff`, the M5 rule: less than 0.1% apart at every evaluation point; or `max_rel_diff`, a
share of the reference's value, for metrics such as perplexity where an absolute band means
little); in `final` mode, the last matched point. A trnflow series says which way each of its
metrics is better (`"directions": {"loss": "lower", ...}`); a comparison with the champion lets
the candidate be better by any amount, in that direction. `predictions.correct` has one character
per holdout row, in holdout order: '1' when that row was predicted right. When the gate's metric
is accuracy and both sides have it for the same holdout (the same `holdout_sha256`) at the same
step, the gate adds McNemar's paired test: on a large holdout it finds differences smaller than the
band, and on a small one it says how many rows a 0.1% difference would need.
"""

from __future__ import annotations

import json
import math
from statistics import NormalDist

from pydantic import ValidationError

from trnflow.errors import DataError
from trnflow.records import (
    Band,
    MetricPoint,
    MetricSeries,
    PairedCheck,
    Predictions,
    Verdict,
    VerdictPoint,
    problems,
    read,
)
from trnflow.storage import open_store

FORMAT = 1
SERIES = "metrics.json"
"""A run's metric series, in its checkpoint folder."""
POWER = 0.8
EXACT_LIMIT = 20_000
"""Discordant pairs up to which McNemar's test is the exact binomial one (above: chi-square)."""
HIGHER, LOWER = "higher", "lower"
DIRECTIONS = {"accuracy": HIGHER, "f1": HIGHER, "auc": HIGHER, "token_accuracy": HIGHER, "loss": LOWER,
              "perplexity": LOWER}
"""Which way each metric trnflow computes is better (a recipe states its own metrics' directions)."""
PAIRED_METRIC = "accuracy"
"""McNemar's test pairs per-row correctness: it speaks to accuracy only."""


def series_of(points: list[MetricPoint], source: str, **more) -> MetricSeries:
    """A metric series of `points` (sorted by step), from `source`."""
    return MetricSeries(format=FORMAT, source=source, points=sorted(points, key=lambda p: p.step), **more)


def write_series(run_url: str, run_id: str, points: list[MetricPoint], holdout: str, step: int, correct: str | None,
                 directions: dict[str, str]) -> str:
    """Write a run's metric series beside its checkpoints, with which way each metric is better
    and the per-example outcome at `step` (None: its recipe has none); returns its URL."""
    predictions = Predictions(step=step, correct=correct) if correct is not None else None
    series = series_of(points, run_id, holdout_sha256=holdout, directions=directions, predictions=predictions)
    open_store(run_url).write(SERIES, series.model_dump_json(indent=1, exclude_none=True).encode())
    return f"{run_url}/{SERIES}"


def read_series(run_url: str) -> MetricSeries | None:
    """A run's series; None when it has none, a RecordError (naming the file) when it is damaged."""
    try:
        data = open_store(run_url).read(SERIES)
    except FileNotFoundError:
        return None
    return read(MetricSeries, data, f"{run_url}/{SERIES}")


def parse_metrics(text: str, origin: str, metric: str) -> MetricSeries:
    """A checked metrics file, or DataError naming the file and what a good one looks like."""
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
    predictions = doc.get("predictions")
    if predictions is not None and not (
            isinstance(predictions, dict) and isinstance(predictions.get("step"), int)
            and isinstance(predictions.get("correct"), str) and set(predictions["correct"]) <= {"0", "1"}):
        raise DataError(f'{origin}: "predictions" must be {{"step": N, "correct": "0110..."}} with one 0 or 1 '
                        "per holdout row; remove it if the file has no per-example outcomes")
    try:
        return MetricSeries.model_validate(doc)
    except ValidationError as exc:
        raise DataError(f"{origin}: not a metrics file ({problems(exc)})") from None


def better(series: MetricSeries | None, metric: str) -> str:
    """Which way `metric` is better: as the series says, else as for trnflow's own metrics."""
    said = series.directions.get(metric) if series is not None else None
    if said in (HIGHER, LOWER):
        return said
    if metric not in DIRECTIONS:
        raise DataError(f"the candidate's series does not say whether a higher or a lower {metric} is better; "
                        "evaluate it again with this version of trnflow")
    return DIRECTIONS[metric]


def mcnemar_p(candidate_only: int, reference_only: int) -> float:
    """Two-sided p-value of McNemar's test on the discordant pairs."""
    n = candidate_only + reference_only
    if n == 0:
        return 1.0
    k = min(candidate_only, reference_only)
    if n <= EXACT_LIMIT:  # exact: the discordant pairs split like fair coin flips under the null
        head = math.lgamma(n + 1) - n * math.log(2)
        logs = [head - math.lgamma(i + 1) - math.lgamma(n - i + 1) for i in range(k + 1)]
        top = max(logs)
        tail = math.exp(top) * sum(math.exp(v - top) for v in logs)
        return min(1.0, 2 * tail)
    chi2 = (abs(candidate_only - reference_only) - 1) ** 2 / n  # with continuity correction
    return math.erfc(math.sqrt(chi2 / 2))


def rows_needed(discordant: float, delta: float, alpha: float, power: float = POWER) -> int:
    """Holdout rows for McNemar's test to detect an accuracy difference of `delta` (Connor's
    formula), given the share of rows on which the two models disagree."""
    psi = max(discordant, 2 * delta)  # a difference of delta needs at least that much disagreement
    z_a, z_b = NormalDist().inv_cdf(1 - alpha / 2), NormalDist().inv_cdf(power)
    return math.ceil((z_a * math.sqrt(psi) + z_b * math.sqrt(psi - delta ** 2)) ** 2 / delta ** 2)


def paired_check(candidate: MetricSeries, reference: MetricSeries, metric: str, delta: float, alpha: float
                 ) -> PairedCheck:
    """McNemar's test on per-example outcomes, when the gate's metric is accuracy and both documents
    have them for the same holdout."""
    if metric != PAIRED_METRIC:
        return PairedCheck(available=False, reason=f"it pairs per-row correctness, which speaks to accuracy, and "
                           f"the gate's metric is {metric}")
    cand, ref = candidate.predictions, reference.predictions
    if not cand or not ref:
        return PairedCheck(available=False, reason="per-example predictions missing on the "
                           f"{'candidate' if not cand else 'reference'} side")
    if candidate.holdout_sha256 != reference.holdout_sha256:
        return PairedCheck(available=False, reason="the two runs were evaluated on different holdout sets")
    if cand.step != ref.step:
        return PairedCheck(available=False, reason=f"predictions are at different steps ({cand.step} and {ref.step})")
    if len(cand.correct) != len(ref.correct) or not cand.correct:
        return PairedCheck(available=False, reason=f"predictions cover {len(cand.correct)} and "
                           f"{len(ref.correct)} rows: not the same holdout")
    pairs = list(zip(cand.correct, ref.correct, strict=True))
    candidate_only = sum(1 for c, r in pairs if c == "1" and r == "0")
    reference_only = sum(1 for c, r in pairs if c == "0" and r == "1")
    rows = len(pairs)
    p = mcnemar_p(candidate_only, reference_only)
    needed = rows_needed((candidate_only + reference_only) / rows, delta, alpha) if delta > 0 else 0
    return PairedCheck(
        available=True, step=cand.step, rows=rows,
        both_right=sum(1 for c, r in pairs if c == r == "1"), candidate_only=candidate_only,
        reference_only=reference_only, both_wrong=sum(1 for c, r in pairs if c == r == "0"),
        p_value=p, alpha=alpha, significant=p < alpha, rows_needed=needed, underpowered=rows < needed,
    )


def no_regression(candidate: MetricSeries, champion: MetricSeries, band: Band, champion_label: str,
                  alpha: float = 0.05) -> Verdict:
    """The verdict of a retrained model against the champion it started from: its final point may
    be better by any amount, and worse by at most the band. The two series come from different
    runs on different data windows, so their last points are compared, not their steps."""
    metric = band.metric
    last, best = candidate.last.value(metric), champion.last.value(metric)
    diff = last - best
    allowed = band.allowed(best)
    passed = band.regression(diff) <= allowed

    def final(series: MetricSeries) -> MetricSeries:  # each model's outcome at its own last step, paired row by row
        known = series.predictions
        return series.model_copy(update={"predictions": known and known.model_copy(update={"step": "final"})})

    point = VerdictPoint(step=candidate.last.step, global_step=candidate.last.global_step, candidate=last,
                         reference=best, diff=diff, passed=passed)
    worse = "below" if band.better == HIGHER else "above"
    relative = f", {band.text}" if band.max_rel_diff is not None else ""
    reason = None if passed else (f"{metric} {last:.4f} is {abs(diff):.4f} {worse} {champion_label}'s "
                                  f"{best:.4f} (allowed regression {allowed:.4g}{relative})")
    return Verdict(**band.model_dump(), mode="no-regression", passed=passed, points=[point],
                   paired=paired_check(final(candidate), final(champion), metric, allowed, alpha), reason=reason)


def compare(candidate: MetricSeries | list[MetricPoint], reference: MetricSeries | list[MetricPoint], band: Band,
            mode: str = "every-point", alpha: float = 0.05, fail_on_significant: bool = False) -> Verdict:
    """The verdict: every matched point with both values, their difference and pass or fail, plus
    the paired check. Series or bare point lists are accepted."""
    metric = band.metric
    cand_doc = candidate if isinstance(candidate, MetricSeries) else MetricSeries(points=candidate)
    ref_doc = reference if isinstance(reference, MetricSeries) else MetricSeries(points=reference)
    ref_by_step = {p.step: p.value(metric) for p in ref_doc.points}
    rows = []
    for point in sorted(cand_doc.points, key=lambda p: p.step):
        if point.step not in ref_by_step:
            continue
        ref = ref_by_step[point.step]
        diff = point.value(metric) - ref
        rows.append(VerdictPoint(step=point.step, global_step=point.global_step, candidate=point.value(metric),
                                 reference=ref, diff=diff, passed=abs(diff) <= band.allowed(ref)))
    delta = band.allowed(rows[-1].reference if rows else next(reversed(ref_by_step.values()), 0.0))
    paired = paired_check(cand_doc, ref_doc, metric, delta, alpha)
    if not rows:
        return Verdict(**band.model_dump(), mode=mode, passed=False, paired=paired, reason=(
            f"no common evaluation step: candidate steps {cand_doc.steps()}, "
            f"reference steps {sorted(ref_by_step)}; evaluate both at the same steps"))
    judged = rows if mode == "every-point" else rows[-1:]
    reasons = [f"step {r.step}: {metric} {r.candidate:.4f} vs reference {r.reference:.4f} "
               f"(diff {r.diff:+.4f}, allowed {band.text})" for r in judged if not r.passed]
    if fail_on_significant and paired.significant:
        reasons.append(f"McNemar's test finds the two models differ (p = {paired.p_value:.2g} < {alpha})")
    return Verdict(**band.model_dump(), mode=mode, passed=not reasons, points=rows, paired=paired,
                   reason="; ".join(reasons) or None)


def headline(verdict: Verdict, against: str) -> str:
    """A failed verdict in one short line (a run's state message, which the UI shows up to about 70
    characters): the point furthest outside the band, then how many others are; the whole reason
    when no point failed."""
    failing = [p for p in verdict.points if not p.passed]
    if not failing:
        return f"against {against}: {verdict.reason or 'failed'}"
    worst = max(failing, key=lambda p: abs(p.diff))
    others = len(failing) - 1
    more = f"; {others} more step{'s' if others > 1 else ''} outside it" if others else ""
    return f"{verdict.metric} {worst.diff:+.4f} vs {against} at step {worst.step} (allowed {verdict.text}){more}"
