"""Stage 5: the accuracy-parity gate, then registration and promotion in the model registry.

The candidate's metric series was written during training (every `gate.eval_every` steps and at
the end); a checkpoint without its point is evaluated first. What it is judged against, and how,
is `trnflow.lifecycle.judge`'s. The verdict, a markdown table and the parity chart are attached to
the flow run as artifacts and saved beside the checkpoint.

Scheduled retraining promotes only at the end of its run (`promote=False` here, then
`promote_champion`).
"""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.lifecycle import judge
from trnflow.lifecycle.registry import Registry
from trnflow.records import MetricSeries, dump
from trnflow.reporting.chart import parity_png, verdict_markdown
from trnflow.results import EvaluateResult
from trnflow.specs import JobSpec
from trnflow.storage import open_store
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import recompile_note, run_job
from trnflow.teams import Team


def _attach(spec: JobSpec, candidate: judge.Candidate, decision: judge.Decision, title: str, outcome: str) -> str:
    """Save the chart and verdict beside the checkpoints and attach them to the flow run."""
    verdict, reference = decision.verdict, decision.reference
    assert candidate.series is not None
    png = parity_png(verdict, candidate.series.points, reference.points if reference else None, f"{title}: {outcome}")
    store = open_store(candidate.run_url)
    store.write("parity.png", png)
    store.write("verdict.json", dump(verdict))
    markdown = "\n".join(verdict_markdown(v, f"{title} against {who}" if who else title)
                         for who, v in verdict.each().items())
    _artifacts.markdown(spec, "gate", markdown, f"accuracy-parity verdict of {candidate.run_url}")
    _artifacts.image(spec, "parity", png, f"{spec.gate.metric} against global step: candidate and reference")
    return f"{candidate.run_url}/parity.png"


def _champion(spec: JobSpec, registry: Registry | None, candidate: judge.Candidate, run_id: str,
              cores: list[int] | None, team: Team | None) -> tuple[MetricSeries, str] | judge.Check | None:
    """The champion's series on the candidate's holdout, and its name; None before the first. A
    champion measured on another holdout (or never measured) is evaluated on this one first, so
    that the two are compared row for row."""
    champion = registry.champion(spec.name) if registry else None
    if champion is None:
        return None
    who = f"champion v{champion.version}"
    series = judge.recorded_series(champion.checkpoint)
    assert candidate.series is not None
    if (series is None or not series.points or not judge.same_holdout(candidate.series, series)
            or spec.gate.metric not in series.last.values):  # measured before the gate's metric was chosen
        theirs, ours = champion.entry.recipe, judge.recipe_of(candidate.checkpoint)
        if theirs and ours and theirs != ours:  # this spec's model cannot load the champion's weights
            return judge.incomparable(spec, candidate.series, who,
                                      f"{who} is another model ({theirs.label()}; this run's is {ours.label()}) "
                                      "measured on another holdout, so the two cannot be compared row for row")
        get_run_logger().info("%s was not measured on this holdout in %s; evaluating it", who, spec.gate.metric)
        result = run_job(spec, "evaluate", run_id, checkpoint=champion.checkpoint, cores=cores, team=team)
        assert isinstance(result, EvaluateResult)
        series = judge.evaluated_series(result.points, result.holdout_sha256, result.points[-1].step,
                                        result.correct)
    return series, who


def _candidate(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None, team: Team | None
               ) -> tuple[judge.Candidate, EvaluateResult]:
    """The candidate's series up to its checkpoint's step; a checkpoint training did not evaluate is
    evaluated first, by a job."""
    candidate = judge.Candidate.read(checkpoint)
    result = EvaluateResult(checkpoint=checkpoint, points=[])
    if not candidate.evaluated():
        result = run_job(spec, "evaluate", run_id, checkpoint=checkpoint, cores=cores, team=team)
        assert isinstance(result, EvaluateResult)
        result.checkpoint = checkpoint
        candidate = judge.Candidate.read(checkpoint)
        candidate.series = candidate.series or judge.evaluated_series(
            result.points, result.holdout_sha256, result.points[-1].step, None, result.directions)
    assert candidate.series is not None  # training's series, or the evaluation's
    candidate.series = judge.up_to(candidate.series, candidate.step)
    return candidate, result


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_gate(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None = None, *,
                  against_champion: bool = False, promote: bool = True, generation: int | None = None,
                  force_promote: str | None = None, team: Team | None = None, reference: str | None = None
                  ) -> EvaluateResult:
    """Compare the candidate's metric series with the gate's reference and with the champion on
    the same holdout; register it, and promote it when it passed both.

    Args:
        against_champion: judge as retraining does (no regression against the reference file).
        promote: promote a candidate that passed; False leaves that to `promote_champion`, and the
            result's `registry.generation` is the champion the decision was made against.
        generation: the registry generation the caller saw when it chose the champion to start
            from (default: the one now); a champion changed since is never overwritten.
        force_promote: the reason to promote a candidate worse than the champion anyway (it must
            still pass the gate); recorded in the registry.
        team: the run's team (`StageRunner.team`), whose jobs they are; None: decided here.
        reference: the metrics file the run's reference stage found or trained (`gate.reference:
            auto`); None: gate.reference's own.

    Raises:
        GateFailed: the candidate is outside the band (never retried; the champion stays).

    A candidate that passed the gate but is worse than the champion is registered, not promoted:
    the stage passes, and its result's `kept` says why the champion stays (the run then ends in
    `ChampionKept`, before inference).
    """
    registry = Registry(spec.registry_url) if spec.registry_url else None
    if generation is None:  # the champion this decision is about
        generation = registry.generation(spec.name) if registry else 0
    candidate, result = _candidate(spec, run_id, checkpoint, cores, team)
    decision = judge.decide(spec, registry, candidate.series, against_champion, reference_at=reference)
    if decision.gate_passed:  # only a candidate that passed the gate can take the champion's place
        champion = _champion(spec, registry, candidate, run_id, cores, team)
        if champion is not None:
            decision = judge.decide(spec, registry, candidate.series, against_champion, champion, reference)
    forced = force_promote if decision.worse_than_champion is not None else None
    chart = _attach(spec, candidate, decision, f"{spec.name} {run_id}", judge.outcome(decision, forced))
    result.points, result.verdict, result.against, result.chart = (candidate.series.points, decision.verdict,
                                                                   decision.against, chart)
    registration = None
    if registry is not None:
        registration = judge.register(spec, registry, candidate, run_id, decision, generation, promote,
                                      forced=forced)
        result.registry = registration
    result.kept, notes = judge.settle(decision, registration, run_id, forced)  # GateFailed raised
    for note in notes:
        get_run_logger().warning(note)
    if result.kept is not None:
        get_run_logger().warning(result.kept.message)
    final = candidate.series.last.value(spec.gate.metric)
    result.summary = judge.summary(spec, decision, final, registration) + recompile_note(result)
    return result
