"""Stage 5: the accuracy-parity gate, then registration and promotion in the model registry.

The candidate's metric series was written during training (every `gate.eval_every` steps and at
the end); a checkpoint without its point is evaluated first. The verdict, a markdown table and
the parity chart are attached to the flow run as artifacts and saved beside the checkpoint.
"""

from __future__ import annotations

import base64
import json

from prefect import get_run_logger, task
from prefect.artifacts import create_image_artifact, create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import recompile_note, run_job
from trnflow.chart import parity_png, verdict_markdown
from trnflow.errors import FatalError, GateFailed
from trnflow.gate import compare, parse_metrics, read_series
from trnflow.registry import Registry
from trnflow.storage import open_store


def _reference(spec: JobSpec, registry: Registry | None) -> tuple[dict | None, str]:
    """The reference document and what it is; None for a first run with nothing to compare with."""
    gate = spec.gate
    if gate.reference is None:
        return None, "no reference set"
    if gate.reference == "champion":
        assert registry is not None  # the spec checks it
        champion = registry.champion(spec.name)
        if champion is None:
            return None, f"no champion of {spec.name} yet"
        series = read_series(champion.checkpoint.rpartition("/")[0])
        if series is None:
            raise FatalError(f"champion v{champion.version} ({champion.checkpoint}) has no metrics.json beside it; "
                             "evaluate it with the evaluate phase, or set gate.reference to a metrics file")
        return series, f"champion v{champion.version}"
    base, _, name = gate.reference.rpartition("/")
    try:
        text = open_store(base).read(name).decode()
    except FileNotFoundError:
        raise FatalError(f"gate.reference {gate.reference} does not exist; create it with "
                         "`trnflow reference SPEC` or point gate.reference at an existing metrics file") from None
    document = parse_metrics(text, gate.reference, gate.metric)
    return document, str(document.get("source") or name)


def _attach(spec: JobSpec, run_url: str, verdict: dict, candidate: dict, reference: dict | None, title: str) -> str:
    """Save the chart and verdict beside the checkpoints and attach them to the flow run."""
    png = parity_png(verdict, candidate["points"], reference["points"] if reference else None, title)
    store = open_store(run_url)
    store.write("parity.png", png)
    store.write("verdict.json", json.dumps(verdict, indent=1).encode())
    create_markdown_artifact(verdict_markdown(verdict, title), key=f"{spec.name}-gate",
                             description=f"accuracy-parity verdict of {run_url}")
    create_image_artifact(f"data:image/png;base64,{base64.b64encode(png).decode()}", key=f"{spec.name}-parity",
                          description=f"{spec.gate.metric} against global step: candidate and reference")
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
              generation: int) -> dict:
    meta = json.loads(open_store(checkpoint).read("meta.json"))
    versions = {v.checkpoint: v.version for v in registry.versions(spec.name)}
    if checkpoint in versions:  # a rerun of the same run: its model is registered already
        version = versions[checkpoint]
        champion = registry.champion(spec.name)
        promote = verdict["passed"] and not (champion and champion.version == version)
        if promote:
            registry.promote(spec.name, version, reason=f"gate passed ({run_id})", expected_generation=generation)
        return {"version": version, "promoted": promote, "registered_before": True}
    entry = registry.register(spec.name, {
        "checkpoint": checkpoint, "run_id": run_id, "status": "passed" if verdict["passed"] else "rejected",
        "metrics": candidate["points"][-1], "series": f"{checkpoint.rpartition('/')[0]}/metrics.json",
        "watermark": meta.get("watermark"), "global_step": meta.get("global_step"),
        "parent": meta.get("parent"), "parent_version": versions.get(meta.get("parent")),
        "spec_digest": spec.digest(), "verdict": {k: verdict.get(k) for k in ("passed", "mode", "reason", "paired")},
    })
    out = {"version": entry.version, "promoted": False}
    if verdict["passed"]:
        registry.promote(spec.name, entry.version, reason=f"gate passed ({run_id})", expected_generation=generation)
        out["promoted"] = True
    return out


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_gate(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None = None) -> dict:
    """Compare the candidate's metric series with the gate's reference; register and promote it.

    Raises:
        GateFailed: the candidate is outside the band (never retried; the champion stays).
    """
    logger = get_run_logger()
    gate = spec.gate
    registry = Registry(spec.registry_url) if spec.registry_url else None
    generation = registry.generation(spec.name) if registry else 0  # the champion this decision is about
    run_url, _, step_name = checkpoint.rpartition("/")
    candidate = read_series(run_url)
    step = int(step_name.removeprefix("step-")) if step_name.startswith("step-") else None
    result: dict = {"checkpoint": checkpoint}
    if candidate is None or step not in {p["step"] for p in candidate["points"]}:
        result = {**run_job(spec, "evaluate", run_id, checkpoint=checkpoint, cores=cores), **result}
        candidate = read_series(run_url) or {"points": result["points"]}
    candidate = _up_to(candidate, step)
    reference, against = _reference(spec, registry)
    title = f"{spec.name} {run_id}"
    if reference is None:
        verdict = {"passed": True, "metric": gate.metric, "mode": gate.mode, "max_abs_diff": gate.max_abs_diff,
                   "points": [], "reason": f"{against}: this run is the baseline"}
    else:
        verdict = compare(candidate, reference, gate.metric, gate.max_abs_diff, gate.mode, gate.significance,
                          gate.fail_on_significant)
    result.update(points=candidate["points"], verdict=verdict, against=against,
                  chart=_attach(spec, run_url, verdict, candidate, reference, title))
    if registry is not None:
        result["registry"] = _register(spec, registry, checkpoint, run_id, candidate, verdict, generation)
    final = candidate["points"][-1][gate.metric]
    if not verdict["passed"]:
        raise GateFailed(f"accuracy-parity gate failed against {against}: {verdict['reason']}", verdict)
    paired = verdict.get("paired") or {}
    if paired.get("significant"):
        logger.warning("McNemar's test finds the candidate and %s differ (p = %.3g), within the band", against,
                       paired["p_value"])
    if reference is None:
        summary = f"{gate.metric} {final:.4f}; {against}, recorded as baseline"
    else:
        judged = verdict["points"] if gate.mode == "every-point" else verdict["points"][-1:]
        worst = max(abs(p["diff"]) for p in judged)
        summary = f"{gate.metric} {final:.4f}, max |diff| {worst:.4f} <= {gate.max_abs_diff} vs {against}: passed"
    if result.get("registry", {}).get("promoted"):
        summary += f"; champion v{result['registry']['version']}"
    result["summary"] = summary + recompile_note(result)
    return result
