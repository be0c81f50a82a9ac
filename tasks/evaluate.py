"""Stage 5: the accuracy-parity gate, then registration and promotion in the model registry.

The candidate's metric series was written during training (every `gate.eval_every` steps and at
the end); a checkpoint without its point is evaluated first. What it is judged against, and how,
is `trnflow.lifecycle.judge`'s. The verdict, a markdown table and the parity chart are attached to
the flow run as artifacts and saved beside the checkpoint.

Scheduled retraining promotes only at the end of its run (`promote=False` here, then
`promote_champion`).
"""

from __future__ import annotations

import json

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.errors import ChampionKept, GateFailed
from trnflow.lifecycle import gate, judge
from trnflow.lifecycle.registry import Registry
from trnflow.records import dump
from trnflow.reporting.chart import parity_png, verdict_markdown
from trnflow.results import EvaluateResult
from trnflow.specs import JobSpec
from trnflow.storage import open_store
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import recompile_note, run_job
from trnflow.teams import Team


def _attach(spec: JobSpec, candidate: judge.Candidate, decision: judge.Decision, title: str) -> str:
    """Save the chart and verdict beside the checkpoints and attach them to the flow run."""
    verdict, reference = decision.verdict, decision.reference
    png = parity_png(verdict, candidate.series["points"], reference["points"] if reference else None, title)
    store = open_store(candidate.run_url)
    store.write("parity.png", png)
    store.write("verdict.json", dump(verdict))
    markdown = "\n".join(verdict_markdown(v, f"{title} against {who}" if who else title)
                         for who, v in verdict.each().items())
    _artifacts.markdown(spec, "gate", markdown, f"accuracy-parity verdict of {candidate.run_url}")
    _artifacts.image(spec, "parity", png, f"{spec.gate.metric} against global step: candidate and reference")
    return f"{candidate.run_url}/parity.png"


def _model(recipe: dict) -> str:
    return f"{recipe.get('recipe')}@{recipe.get('version')} {json.dumps(recipe.get('params'), sort_keys=True)}"


def _champion(spec: JobSpec, registry: Registry | None, candidate: judge.Candidate, run_id: str,
              cores: list[int] | None, team: Team | None) -> tuple[dict, str] | judge.Check | None:
    """The champion's series on the candidate's holdout, and its name; None before the first. A
    champion measured on another holdout (or never measured) is evaluated on this one first, so
    that the two are compared row for row."""
    champion = registry.champion(spec.name) if registry else None
    if champion is None:
        return None
    who = f"champion v{champion.version}"
    series = judge.recorded_series(champion.checkpoint)
    if (series is None or not series["points"] or not judge.same_holdout(candidate.series, series)
            or spec.gate.metric not in series["points"][-1]):  # measured before the gate's metric was chosen
        theirs, ours = champion.entry.recipe, judge.recipe_of(candidate.checkpoint)
        if theirs and ours and theirs != ours:  # this spec's model cannot load the champion's weights
            return judge.incomparable(spec, candidate.series, who,
                                      f"{who} is another model ({_model(theirs)}; this run's is {_model(ours)}) "
                                      "measured on another holdout, so the two cannot be compared row for row")
        get_run_logger().info("%s was not measured on this holdout in %s; evaluating it", who, spec.gate.metric)
        result = run_job(spec, "evaluate", run_id, checkpoint=champion.checkpoint, cores=cores, team=team)
        assert isinstance(result, EvaluateResult)
        series = judge.evaluated_series(result.points, result.holdout_sha256, result.points[-1]["step"],
                                        result.correct)
    return series, who


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_gate(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None = None, *,
                  against_champion: bool = False, promote: bool = True, generation: int | None = None,
                  force_promote: str | None = None, team: Team | None = None) -> EvaluateResult:
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

    Raises:
        GateFailed: the candidate is outside the band (never retried; the champion stays).
        ChampionKept: it passed the gate but is worse than the champion (never retried).
    """
    registry = Registry(spec.registry_url) if spec.registry_url else None
    if generation is None:  # the champion this decision is about
        generation = registry.generation(spec.name) if registry else 0
    candidate = judge.Candidate.read(checkpoint)
    result = EvaluateResult(checkpoint=checkpoint, points=[])
    if not candidate.evaluated():
        result = run_job(spec, "evaluate", run_id, checkpoint=checkpoint, cores=cores, team=team)
        assert isinstance(result, EvaluateResult)
        result.checkpoint = checkpoint
        candidate = judge.Candidate.read(checkpoint)
        candidate.series = candidate.series or {"points": result.points, "holdout_sha256": result.holdout_sha256,
                                                "directions": result.directions}
    candidate.series = judge.up_to(candidate.series, candidate.step)
    decision = judge.decide(spec, registry, candidate.series, against_champion)
    if decision.gate_passed:  # only a candidate that passed the gate can take the champion's place
        champion = _champion(spec, registry, candidate, run_id, cores, team)
        if champion is not None:
            decision = judge.decide(spec, registry, candidate.series, against_champion, champion)
    chart = _attach(spec, candidate, decision, f"{spec.name} {run_id}")
    result.points, result.verdict, result.against, result.chart = (candidate.series["points"], decision.verdict,
                                                                   decision.against, chart)
    worse = decision.worse_than_champion
    forced = force_promote if worse is not None else None
    registration = None
    if registry is not None:
        registration = judge.register(spec, registry, candidate, run_id, decision, generation, promote,
                                      forced=forced)
        result.registry = registration.as_dict()
    if not decision.gate_passed:
        raise GateFailed(f"accuracy-parity gate failed against {decision.against}: {decision.verdict.reason}",
                         decision.verdict, headline=gate.headline(decision.verdict, decision.against))
    if worse is not None and forced is None:
        version = f"v{registration.version}" if registration else "the candidate"
        raise ChampionKept(f"{version} passed the gate but was not promoted: {worse.verdict.reason}. "
                           f"{worse.against} stays the champion; to promote it anyway, run the same run again "
                           f"(nothing is trained twice) with --run-id {run_id} --force-promote --reason \"why\"",
                           worse.verdict, headline=f"{version} registered, not promoted: "
                           f"{gate.headline(worse.verdict, worse.against)}")
    if worse is not None:
        get_run_logger().warning("promoting a candidate worse than %s, as asked: %s", worse.against, forced)
    for check in decision.checks:
        paired = check.verdict.paired
        if paired and paired.significant:
            get_run_logger().warning("McNemar's test finds the candidate and %s differ (p = %.3g), within the band",
                                     check.against, paired.p_value)
    final = candidate.series["points"][-1][spec.gate.metric]
    result.summary = judge.summary(spec, decision, final, registration) + recompile_note(result)
    return result
