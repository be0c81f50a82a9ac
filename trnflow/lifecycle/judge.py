"""The gate's decision about one checkpoint: which references it is judged against, the verdict,
its registration in the model registry and the one-line summary a run shows.

A first run of a spec judges the candidate's series against `gate.reference` (a metrics file, or
the champion's series). Scheduled retraining judges twice: against the champion it started from
and against `gate.reference` when that is a file, each as "no regression beyond the band"
(`gate.max_abs_diff`, or `gate.max_rel_diff` of the reference's value) on the final point, in the
direction the metric is better (a retrained model has seen other data, so its curve is not the
reference's).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from trnflow.errors import DataError, FatalError, GateFailed
from trnflow.lifecycle.digests import check_version, registered_digests
from trnflow.lifecycle.gate import better, compare, headline, no_regression, parse_metrics, read_series
from trnflow.lifecycle.references import AUTO, reference_url
from trnflow.lifecycle.registry import Digests, Registry, RegistryEntry, VerdictSummary
from trnflow.records import (
    CHECKPOINT_MARKER,
    Band,
    CheckpointMeta,
    MetricPoint,
    MetricSeries,
    Predictions,
    Verdict,
    read,
)
from trnflow.results import ChampionStays, Registration
from trnflow.specs import JobSpec
from trnflow.storage import open_store


@dataclass(frozen=True)
class Check:
    """One comparison the candidate must pass: its verdict, the series it was judged against
    (None when there was nothing to compare with) and what that series is."""

    verdict: Verdict
    reference: MetricSeries | None
    against: str
    champion: bool = False
    """This check protects the champion: failing it keeps the champion rather than failing the gate."""


@dataclass(frozen=True)
class Decision:
    """Every check of one candidate, and the verdict they add up to."""

    checks: list[Check]
    verdict: Verdict
    """The one check's verdict, or for several: passed only when all passed, each under `checks`."""
    against: str

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    @property
    def gate_passed(self) -> bool:
        """Whether the accuracy-parity checks passed (the champion's protection aside)."""
        return all(c.verdict.passed for c in self.checks if not c.champion)

    @property
    def worse_than_champion(self) -> Check | None:
        """The champion's check, when the candidate passed the gate but failed it."""
        failed = [c for c in self.checks if c.champion and not c.verdict.passed]
        return failed[0] if failed and self.gate_passed else None

    @property
    def reference(self) -> MetricSeries | None:
        """The series the chart draws beside the candidate's: the first check's."""
        return self.checks[0].reference


@dataclass
class Candidate:
    """The candidate's metric series as it stood at the checkpoint being gated."""

    checkpoint: str
    series: MetricSeries | None = None

    @property
    def run_url(self) -> str:
        return self.checkpoint.rpartition("/")[0]

    @property
    def step(self) -> int | None:
        return step_of(self.checkpoint)

    def evaluated(self) -> bool:
        """Whether training left a point for this checkpoint (else the evaluate phase must run)."""
        return self.series is not None and self.step in self.series.steps()

    @classmethod
    def read(cls, checkpoint: str) -> Candidate:
        return cls(checkpoint, read_series(checkpoint.rpartition("/")[0]))


def step_of(checkpoint: str) -> int | None:
    name = checkpoint.rpartition("/")[2]
    return int(name.removeprefix("step-")) if name.startswith("step-") else None


def up_to(series: MetricSeries, step: int | None) -> MetricSeries:
    """The series as it stood at the checkpoint being gated: later points (a newer checkpoint's)
    are not this model's, nor is a per-example outcome taken at another step."""
    if step is None:
        return series
    predictions = series.predictions if series.predictions and series.predictions.step == step else None
    return series.model_copy(update={"points": [p for p in series.points if p.step <= step],
                                     "predictions": predictions})


def champion_series(spec: JobSpec, registry: Registry) -> tuple[MetricSeries | None, str]:
    """The champion's series up to its own checkpoint, and its name; None before the first."""
    champion = registry.champion(spec.name)
    if champion is None:
        return None, f"no champion of {spec.name} yet"
    series = recorded_series(champion.checkpoint)
    if series is None:
        raise FatalError(f"champion v{champion.version} ({champion.checkpoint}) has no metrics.json beside it; "
                         "evaluate it with the evaluate phase, or set gate.reference to a metrics file")
    return series, f"champion v{champion.version}"


def recorded_series(checkpoint: str) -> MetricSeries | None:
    """The series of `checkpoint`'s run as it stood at that checkpoint; None when it has none."""
    series = read_series(checkpoint.rpartition("/")[0])
    return None if series is None else up_to(series, step_of(checkpoint))


def meta_of(checkpoint: str) -> CheckpointMeta | None:
    """A trnflow checkpoint's meta.json (a RecordError naming the file and field when it is
    malformed); None when there is none (a plain state_dict file)."""
    try:
        data = open_store(checkpoint).read("meta.json")
    except FileNotFoundError:
        return None
    return read(CheckpointMeta, data, f"{checkpoint}/meta.json")


def whole_weights(checkpoint: str) -> str | None:
    """The checkpoint's whole weights as a plain state_dict (`model.pt`), when its marker lists them:
    every unsharded checkpoint's does, and a sharded run's last one (`trnflow checkpoint consolidate`
    adds them to another)."""
    try:
        listed = json.loads(open_store(checkpoint).read(CHECKPOINT_MARKER)).get("files", {})
    except (FileNotFoundError, ValueError, AttributeError):  # no marker, or not one to read: no claim made
        return None
    return f"{checkpoint.rstrip('/')}/model.pt" if "model.pt" in listed else None


def recipe_of(checkpoint: str) -> dict | None:
    """The recipe (name, version and params) a trnflow checkpoint was trained with."""
    meta = meta_of(checkpoint)
    return meta.recipe if meta else None


def band(spec: JobSpec, candidate: MetricSeries | None) -> Band:
    """The gate's band for the candidate's series (which says which way its metric is better)."""
    gate = spec.gate
    return Band(metric=gate.metric, max_abs_diff=gate.max_abs_diff, max_rel_diff=gate.max_rel_diff,
                better=better(candidate, gate.metric))


def incomparable(spec: JobSpec, candidate: MetricSeries | None, who: str, reason: str) -> Check:
    """The champion's check when the candidate cannot be compared with it: failed, so the champion
    stays unless a promotion is forced."""
    verdict = Verdict(**band(spec, candidate).model_dump(), passed=False, mode="no-regression", reason=reason)
    return Check(verdict, None, who, champion=True)


def same_holdout(candidate: MetricSeries, champion: MetricSeries) -> bool:
    """Whether the champion's series was measured on the candidate's holdout, row for row (a series
    that does not say which holdout it was measured on is not known to be)."""
    theirs, ours = champion.holdout_sha256, candidate.holdout_sha256
    return theirs is not None and theirs == ours


def evaluated_series(points: list[MetricPoint], holdout: str | None, step: int, correct: str | None,
                     directions: dict[str, str] | None = None) -> MetricSeries:
    """A series from one evaluation (the champion's, on the candidate's holdout)."""
    return MetricSeries(points=points, holdout_sha256=holdout, directions=directions or {},
                        predictions=Predictions(step=step, correct=correct) if correct else None)


def reference_series(spec: JobSpec, registry: Registry | None, url: str | None = None
                     ) -> tuple[MetricSeries | None, str]:
    """The reference document and what it is; None for a first run with nothing to compare with.
    `url`: the metrics file the run's reference stage found or trained (`gate.reference: auto`),
    instead of looking for it again (new data since would name another)."""
    gate = spec.gate
    if gate.reference is None:
        return None, "no reference set"
    if gate.reference == "champion":
        assert registry is not None  # the spec checks it
        return champion_series(spec, registry)
    url = url or reference_url(spec)
    assert url is not None
    base, _, name = url.rpartition("/")
    try:
        text = open_store(base).read(name).decode()
    except FileNotFoundError:
        if gate.reference == AUTO:
            raise FatalError(f"the fp32 reference of this spec and data is not on record at {url}: a pipeline run "
                             "trains it (gate.reference: auto), or `trnflow reference SPEC` does") from None
        raise FatalError(f"gate.reference {gate.reference} does not exist; create it with "
                         "`trnflow reference SPEC` or point gate.reference at an existing metrics file") from None
    document = parse_metrics(text, url, gate.metric)
    return document, document.source or name


def _baseline(spec: JobSpec, candidate: MetricSeries, mode: str, reason: str) -> Verdict:
    return Verdict(**band(spec, candidate).model_dump(), passed=True, mode=mode, reason=reason)


def protect(spec: JobSpec, candidate: MetricSeries, champion: MetricSeries, who: str) -> Check:
    """The champion's protection: the candidate may be better by any amount and worse by at most
    the band on the final point, on the same holdout; with `gate.fail_on_significant`, McNemar's
    test must also not find the champion better."""
    gate = spec.gate
    verdict = no_regression(candidate, champion, band(spec, candidate), who, gate.significance)
    paired = verdict.paired
    if (verdict.passed and gate.fail_on_significant and paired and paired.significant
            and paired.reference_only > paired.candidate_only):
        verdict.passed = verdict.points[0].passed = False
        verdict.reason = (f"McNemar's test finds {who} better on the same holdout (it alone is right on "
                          f"{paired.reference_only} rows, the candidate alone on {paired.candidate_only}; "
                          f"p = {paired.p_value:.2g} < {gate.significance})")
    return Check(verdict, champion, who, champion=True)


def _checks(spec: JobSpec, registry: Registry | None, candidate: MetricSeries, against_champion: bool,
            champion: tuple[MetricSeries, str] | Check | None, reference_at: str | None = None) -> list[Check]:
    gate = spec.gate
    checks = []
    if isinstance(champion, Check):  # decided already: it could not be compared
        checks.append(champion)
    elif champion is not None:
        checks.append(protect(spec, candidate, *champion))
    # retraining: the champion's check covers `champion`, and `auto` would be another run's reference
    if not (against_champion and gate.reference in ("champion", AUTO)):
        reference, who = reference_series(spec, registry, reference_at)
        if reference is not None and against_champion:  # a retrained model must stay as good as the reference
            checks.append(Check(no_regression(candidate, reference, band(spec, candidate), who, gate.significance),
                                reference, who))
        elif reference is not None:
            checks.append(Check(compare(candidate, reference, band(spec, candidate), gate.mode, gate.significance,
                                        gate.fail_on_significant), reference, who))
        elif not checks:
            checks.append(Check(_baseline(spec, candidate, gate.mode, f"{who}: this run is the baseline"), None,
                                who))
        if not against_champion and checks[0].champion and len(checks) > 1:  # the chart draws the reference
            checks.append(checks.pop(0))
    if not checks:  # retraining the first model: nothing to compare with yet
        checks.append(Check(_baseline(spec, candidate, "no-regression",
                                      f"no champion of {spec.name} yet: this run is the baseline"),
                            None, "no champion"))
    return checks


def decide(spec: JobSpec, registry: Registry | None, candidate: MetricSeries, against_champion: bool,
           champion: tuple[MetricSeries, str] | Check | None = None, reference_at: str | None = None) -> Decision:
    """Judge the candidate's series against each reference it must pass, and against `champion`
    (its series on the candidate's holdout, and its name; or a failed check when the two could
    not be compared) when there is one. `reference_at`: where the run's reference stage put the
    automatic reference (`reference_series`)."""
    checks = _checks(spec, registry, candidate, against_champion, champion, reference_at)
    if len(checks) == 1:
        return Decision(checks, checks[0].verdict, checks[0].against)
    failed = [f"against {c.against}: {c.verdict.reason}" for c in checks if not c.verdict.passed]
    verdict = checks[0].verdict.model_copy(update={"passed": not failed, "reason": "; ".join(failed) or None,
                                                   "checks": {c.against: c.verdict for c in checks}})
    return Decision(checks, verdict, " and ".join(c.against for c in checks))


def inputs_digest(spec: JobSpec, meta: CheckpointMeta) -> str:
    """What a trained model is a function of: the spec, the recipe, the model it started from and
    the data files it read (names, sizes and modification times: a file rewritten in place is new
    data). Two runs with the same digest train the same model."""
    files = set(meta.data.files)
    sizes = sorted((o.name, o.size, o.modified) for o in open_store(spec.data.train).list() if o.name in files) \
        if files else []
    blob = {"spec": spec.digest(), "recipe": meta.recipe.model_dump(mode="json"), "parent": meta.parent,
            "watermark": meta.watermark, "files": sorted(files), "sizes": sizes, "rows": meta.data.rows}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _status(decision: Decision, forced: str | None) -> str:
    if not decision.gate_passed:
        return "rejected"
    return "passed" if decision.passed or forced else "worse-than-champion"


def register(spec: JobSpec, registry: Registry, candidate: Candidate, run_id: str, decision: Decision,
             generation: int, promote: bool = True, forced: str | None = None) -> Registration:
    """Register the candidate (once per model: a rerun of the same run, or of the same spec on the
    same data, finds its version) and, when it passed the gate and its champion's protection (or
    `forced` gives the reason to promote it anyway) and `promote`, make it the champion unless the
    champion changed since `generation`."""
    checkpoint, verdict = candidate.checkpoint, decision.verdict
    meta = meta_of(checkpoint)
    if meta is None:
        raise FatalError(f"{checkpoint}: has no meta.json, so it is not a checkpoint a trnflow run trained; "
                         "only those are registered")
    inputs = inputs_digest(spec, meta)
    versions = registry.versions(spec.name)
    by_checkpoint = {v.checkpoint: v.version for v in versions}
    reason = f"forced: {forced} ({run_id})" if forced else f"gate passed ({run_id})"
    promotable = promote and (decision.passed or forced is not None)
    same = [v for v in versions if v.checkpoint == checkpoint or v.entry.inputs == inputs]
    if same:  # a rerun: of the same run, or of the same spec on the same data
        version = same[0].version
        champion = registry.champion(spec.name)
        promoted = promotable and not (champion and champion.version == version)
        if promoted:
            check_version(same[0])  # its files are still the ones registered
            registry.promote(spec.name, version, reason=reason, expected_generation=generation)
        return Registration(version=version, promoted=bool(promoted), generation=generation,
                            checkpoint=same[0].checkpoint, registered_before=True, forced=forced is not None)
    status = _status(decision, forced)
    entry = registry.register(spec.name, RegistryEntry(
        checkpoint=checkpoint, run_id=run_id, status=status,
        metrics=candidate.series.last.model_dump(), series=f"{candidate.run_url}/metrics.json",
        watermark=meta.watermark, global_step=meta.global_step,
        parent=meta.parent, parent_version=by_checkpoint.get(meta.parent) if meta.parent else None,
        recipe=meta.recipe, export=meta.export, base=meta.base, weights=whole_weights(checkpoint), inputs=inputs,
        output_url=spec.inference.output_url, tracking=spec.tracking.mlflow_uri,
        spec_digest=spec.digest(), forced=forced, digests=_digests(checkpoint, meta.export),
        verdict=VerdictSummary(passed=verdict.passed, mode=verdict.mode, metric=verdict.metric, reason=verdict.reason,
                               paired=verdict.paired),
    ))
    promoted = bool(promotable)
    if promoted:
        registry.promote(spec.name, entry.version, reason=reason, expected_generation=generation)
    return Registration(version=entry.version, promoted=promoted, generation=generation, checkpoint=checkpoint,
                        forced=forced is not None)


def _digests(checkpoint: str, export: str | None) -> Digests:
    """The candidate's files as this process reads and checks them now, for its registry entry."""
    try:
        return registered_digests(checkpoint, export)
    except DataError as exc:
        raise FatalError(f"{exc}: the candidate's files changed after its job ended, so it is not registered; "
                         "run it again") from None


def summary(spec: JobSpec, decision: Decision, final: float, registration: Registration | None) -> str:
    """The gate's key figure: the final metric and how it compares with what it was judged against."""
    gate, verdicts = spec.gate, [c.verdict for c in decision.checks]
    if decision.reference is None and len(verdicts) == 1:
        text = f"{gate.metric} {final:.4f}; {decision.against}, recorded as baseline"
    elif all(v.mode == "no-regression" for v in verdicts):  # better by any amount, worse by at most the band
        change = max((p.diff for v in verdicts for p in v.points), key=verdicts[0].regression, default=0.0)
        text = (f"{gate.metric} {final:.4f}, {change:+.4f} vs {decision.against} (allowed regression "
                f"{verdicts[0].text}): passed")
    else:
        rows = [p for v in verdicts for p in (v.points if v.mode == "every-point" else v.points[-1:])]
        worst = max((abs(p.diff) for p in rows), default=0.0)
        text = (f"{gate.metric} {final:.4f}, max |diff| {worst:.4f} within {verdicts[0].text} vs "
                f"{decision.against}: passed")
    if registration is not None and registration.promoted:
        text += f"; champion v{registration.version}"
    return text


def settle(decision: Decision, registration: Registration | None, run_id: str, forced: str | None
           ) -> tuple[ChampionStays | None, list[str]]:
    """The gate's outcome once the candidate is registered: GateFailed when it is outside the band
    (never retried). Otherwise whether the champion stays (the candidate passed but is worse than the
    champion, and `forced` gives no reason to promote it anyway), and the warnings the run should
    show: a forced promotion, and a paired test that finds the two differ within the band."""
    if not decision.gate_passed:
        raise GateFailed(f"accuracy-parity gate failed against {decision.against}: {decision.verdict.reason}",
                         decision.verdict, headline=headline(decision.verdict, decision.against))
    worse = decision.worse_than_champion
    kept = None
    if worse is not None and forced is None:
        version = f"v{registration.version}" if registration else "the candidate"
        kept = ChampionStays(
            message=f"{version} passed the gate but was not promoted: {worse.verdict.reason}. {worse.against} stays "
                    f"the champion; to promote it anyway, run the same run again (nothing is trained twice) with "
                    f"--run-id {run_id} --force-promote --reason \"why\"",
            headline=f"{version} registered, not promoted: {headline(worse.verdict, worse.against)}")
    notes = [f"promoting a candidate worse than {worse.against}, as asked: {forced}"] if worse and forced else []
    for check in decision.checks:
        paired = check.verdict.paired
        if paired and paired.significant:
            notes.append(f"McNemar's test finds the candidate and {check.against} differ (p = "
                         f"{paired.p_value:.3g}), within the band")
    return kept, notes


def outcome(decision: Decision, forced: str | None = None) -> str:
    """The decision in a few words, as the parity chart's title ends: `gate passed`, `gate FAILED`,
    `gate passed; champion v1 kept` (the candidate is worse than it), or with `forced` (a reason to
    promote it anyway) `gate passed; promoted over champion v1, as asked`."""
    if not decision.gate_passed:
        return "gate FAILED"
    worse = decision.worse_than_champion
    if worse is None:
        return "gate passed"
    return f"gate passed; promoted over {worse.against}, as asked" if forced else f"gate passed; {worse.against} kept"
