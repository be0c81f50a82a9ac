"""Stage 5: the accuracy-parity gate, then registration and promotion in the model registry.

The candidate's metric series was written during training (every `gate.eval_every` steps and at
the end); a checkpoint without its point is evaluated first. The verdict, a markdown table and
the parity chart are attached to the flow run as artifacts and saved beside the checkpoint.

Scheduled retraining gates twice: against the champion it started from and against `gate.reference`
when that is a file, each as "no regression beyond `gate.max_abs_diff`" on the final point (a
retrained model has seen other data, so its curve is not the reference's); it promotes only at the
end of its run (`promote=False` here, then `promote_champion`).
"""

from __future__ import annotations

import json

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.errors import FatalError, GateFailed
from trnflow.lifecycle.gate import compare, no_regression, parse_metrics, read_series
from trnflow.lifecycle.registry import Registry
from trnflow.reporting.chart import parity_png, verdict_markdown
from trnflow.specs import JobSpec
from trnflow.storage import open_store
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import recompile_note, run_job


def _reference(spec: JobSpec, registry: Registry | None) -> tuple[dict | None, str]:
    """The reference document and what it is; None for a first run with nothing to compare with."""
    gate = spec.gate
    if gate.reference is None:
        return None, "no reference set"
    if gate.reference == "champion":
        assert registry is not None  # the spec checks it
        return _champion_series(spec, registry)
    base, _, name = gate.reference.rpartition("/")
    try:
        text = open_store(base).read(name).decode()
    except FileNotFoundError:
        raise FatalError(f"gate.reference {gate.reference} does not exist; create it with "
                         "`trnflow reference SPEC` or point gate.reference at an existing metrics file") from None
    document = parse_metrics(text, gate.reference, gate.metric)
    return document, str(document.get("source") or name)


def _champion_series(spec: JobSpec, registry: Registry) -> tuple[dict | None, str]:
    champion = registry.champion(spec.name)
    if champion is None:
        return None, f"no champion of {spec.name} yet"
    series = read_series(champion.checkpoint.rpartition("/")[0])
    if series is None:
        raise FatalError(f"champion v{champion.version} ({champion.checkpoint}) has no metrics.json beside it; "
                         "evaluate it with the evaluate phase, or set gate.reference to a metrics file")
    return _up_to(series, _step_of(champion.checkpoint)), f"champion v{champion.version}"


def _step_of(checkpoint: str) -> int | None:
    name = checkpoint.rpartition("/")[2]
    return int(name.removeprefix("step-")) if name.startswith("step-") else None


def _attach(spec: JobSpec, run_url: str, verdict: dict, candidate: dict, reference: dict | None, title: str) -> str:
    """Save the chart and verdict beside the checkpoints and attach them to the flow run."""
    png = parity_png(verdict, candidate["points"], reference["points"] if reference else None, title)
    store = open_store(run_url)
    store.write("parity.png", png)
    store.write("verdict.json", json.dumps(verdict, indent=1).encode())
    checks = verdict.get("checks") or {"": verdict}
    markdown = "\n".join(verdict_markdown(v, f"{title} against {who}" if who else title) for who, v in checks.items())
    _artifacts.markdown(spec, "gate", markdown, f"accuracy-parity verdict of {run_url}")
    _artifacts.image(spec, "parity", png, f"{spec.gate.metric} against global step: candidate and reference")
    return f"{run_url}/parity.png"


def _up_to(series: dict, step: int | None) -> dict:
    """The series as it stood at the checkpoint being gated: later points (a newer checkpoint's)
    are not this model's, nor is a per-example outcome taken at another step."""
    if step is None:
        return series
    trimmed = {**series, "points": [p for p in series["points"] if p["step"] <= step]}
    if (series.get("predictions") or {}).get("step") != step:
        trimmed.pop("predictions", None)
    return trimmed


def _register(spec: JobSpec, registry: Registry, checkpoint: str, run_id: str, candidate: dict, verdict: dict,
              generation: int, promote: bool = True) -> dict:
    """Register the candidate (once per checkpoint) and, when it passed and `promote`, make it the
    champion unless the champion changed since `generation`."""
    meta = json.loads(open_store(checkpoint).read("meta.json"))
    versions = {v.checkpoint: v.version for v in registry.versions(spec.name)}
    if checkpoint in versions:  # a rerun of the same run: its model is registered already
        version = versions[checkpoint]
        champion = registry.champion(spec.name)
        promoted = promote and verdict["passed"] and not (champion and champion.version == version)
        if promoted:
            registry.promote(spec.name, version, reason=f"gate passed ({run_id})", expected_generation=generation)
        return {"version": version, "promoted": promoted, "registered_before": True}
    entry = registry.register(spec.name, {
        "checkpoint": checkpoint, "run_id": run_id, "status": "passed" if verdict["passed"] else "rejected",
        "metrics": candidate["points"][-1], "series": f"{checkpoint.rpartition('/')[0]}/metrics.json",
        "watermark": meta.get("watermark"), "global_step": meta.get("global_step"),
        "parent": meta.get("parent"), "parent_version": versions.get(meta.get("parent")),
        "spec_digest": spec.digest(), "verdict": {k: verdict.get(k) for k in ("passed", "mode", "reason", "paired")},
    })
    out = {"version": entry.version, "promoted": False}
    if verdict["passed"] and promote:
        registry.promote(spec.name, entry.version, reason=f"gate passed ({run_id})", expected_generation=generation)
        out["promoted"] = True
    return out


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_gate(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None = None, *,
                  against_champion: bool = False, promote: bool = True, generation: int | None = None) -> dict:
    """Compare the candidate's metric series with the gate's reference; register and promote it.

    Args:
        against_champion: also require no regression against the current champion (retraining).
        promote: promote a candidate that passed; False leaves that to `promote_champion`, and the
            result's `registry.generation` is the champion the decision was made against.
        generation: the registry generation the caller saw when it chose the champion to start
            from (default: the one now); a champion changed since is never overwritten.

    Raises:
        GateFailed: the candidate is outside the band (never retried; the champion stays).
    """
    logger = get_run_logger()
    gate = spec.gate
    registry = Registry(spec.registry_url) if spec.registry_url else None
    if generation is None:  # the champion this decision is about
        generation = registry.generation(spec.name) if registry else 0
    run_url = checkpoint.rpartition("/")[0]
    candidate = read_series(run_url)
    step = _step_of(checkpoint)
    result: dict = {"checkpoint": checkpoint}
    if candidate is None or step not in {p["step"] for p in candidate["points"]}:
        result = {**run_job(spec, "evaluate", run_id, checkpoint=checkpoint, cores=cores), **result}
        candidate = read_series(run_url) or {"points": result["points"]}
    candidate = _up_to(candidate, step)
    judged = _verdicts(spec, registry, candidate, against_champion)
    verdict, reference, against = judged[0]
    if len(judged) > 1:
        failed = [f"against {who}: {v['reason']}" for v, _, who in judged if not v["passed"]]
        verdict = {**verdict, "passed": not failed, "reason": "; ".join(failed) or None,
                   "checks": {who: v for v, _, who in judged}}
        against = " and ".join(who for _, _, who in judged)
    title = f"{spec.name} {run_id}"
    result.update(points=candidate["points"], verdict=verdict, against=against,
                  chart=_attach(spec, run_url, verdict, candidate, reference, title))
    if registry is not None:
        result["registry"] = {**_register(spec, registry, checkpoint, run_id, candidate, verdict, generation,
                                          promote), "generation": generation}
    final = candidate["points"][-1][gate.metric]
    if not verdict["passed"]:
        raise GateFailed(f"accuracy-parity gate failed against {against}: {verdict['reason']}", verdict)
    for checked, _, who in judged:
        paired = checked.get("paired") or {}
        if paired.get("significant"):
            logger.warning("McNemar's test finds the candidate and %s differ (p = %.3g), within the band", who,
                           paired["p_value"])
    if reference is None and len(judged) == 1:
        summary = f"{gate.metric} {final:.4f}; {against}, recorded as baseline"
    elif all(v["mode"] == "no-regression" for v, _, _ in judged):  # better by any amount, worse by at most the band
        change = min((p["diff"] for v, _, _ in judged for p in v["points"]), default=0.0)
        summary = (f"{gate.metric} {final:.4f}, {change:+.4f} vs {against} (allowed regression "
                   f"{gate.max_abs_diff}): passed")
    else:
        rows = [p for v, _, _ in judged for p in (v["points"] if v["mode"] == "every-point" else v["points"][-1:])]
        worst = max((abs(p["diff"]) for p in rows), default=0.0)
        summary = f"{gate.metric} {final:.4f}, max |diff| {worst:.4f} <= {gate.max_abs_diff} vs {against}: passed"
    if result.get("registry", {}).get("promoted"):
        summary += f"; champion v{result['registry']['version']}"
    result["summary"] = summary + recompile_note(result)
    return result


def _verdicts(spec: JobSpec, registry: Registry | None, candidate: dict, against_champion: bool
              ) -> list[tuple[dict, dict | None, str]]:
    """(verdict, reference series, what it is) for each check the candidate must pass."""
    gate = spec.gate
    checks = []
    if against_champion:
        assert registry is not None  # retraining needs a registry
        champion, who = _champion_series(spec, registry)
        if champion is not None:
            checks.append((no_regression(candidate, champion, gate.metric, gate.max_abs_diff, who,
                                         gate.significance), champion, who))
    if not (against_champion and gate.reference == "champion"):  # the check above covers the champion
        reference, who = _reference(spec, registry)
        if reference is not None and against_champion:  # a retrained model must stay as good as the reference
            checks.append((no_regression(candidate, reference, gate.metric, gate.max_abs_diff, who,
                                         gate.significance), reference, who))
        elif reference is not None:
            checks.append((compare(candidate, reference, gate.metric, gate.max_abs_diff, gate.mode,
                                   gate.significance, gate.fail_on_significant), reference, who))
        elif not checks:
            checks.append(({"passed": True, "metric": gate.metric, "mode": gate.mode, "points": [],
                            "max_abs_diff": gate.max_abs_diff, "reason": f"{who}: this run is the baseline"},
                           None, who))
    if not checks:  # retraining the first model: nothing to compare with yet
        checks.append(({"passed": True, "metric": gate.metric, "mode": "no-regression", "points": [],
                        "max_abs_diff": gate.max_abs_diff,
                        "reason": f"no champion of {spec.name} yet: this run is the baseline"}, None, "no champion"))
    return checks
