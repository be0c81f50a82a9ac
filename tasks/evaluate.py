"""Stage 5: evaluation against the accuracy-parity gate."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from jobspecs import JobSpec
from tasks._jobs import recompile_note, run_job
from trnflow.errors import FatalError, GateFailed
from trnflow.gate import compare, parse_metrics
from trnflow.storage import local_path


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_gate(spec: JobSpec, run_id: str, checkpoint: str, cores: list[int] | None = None) -> dict:
    """Evaluate the checkpoint on the holdout set and compare it with the gate's reference.

    Raises:
        GateFailed: the candidate is outside `gate.max_abs_diff` of the reference (never retried).
    """
    result = run_job(spec, "evaluate", run_id, checkpoint=checkpoint, cores=cores)
    recompiled = recompile_note(result)
    gate, points = spec.gate, result["points"]
    final = points[-1][gate.metric]
    if gate.reference is None:
        result["verdict"] = {"passed": True, "points": [], "reason": "no reference: this run is the baseline"}
        result["summary"] = f"{gate.metric} {final:.4f}; no reference set, recorded as baseline{recompiled}"
        return result
    path = local_path(gate.reference)
    if not path.is_file():
        raise FatalError(f"gate.reference {gate.reference} does not exist; create it with "
                         "`trnflow reference SPEC` or point gate.reference at an existing metrics file")
    reference = parse_metrics(path.read_text(), gate.reference, gate.metric)
    verdict = compare(points, reference, gate.metric, gate.max_abs_diff)
    result["verdict"] = verdict
    if not verdict["passed"]:
        raise GateFailed(f"accuracy-parity gate failed: {verdict['reason']}", verdict)
    worst = max(abs(p["diff"]) for p in verdict["points"])
    result["summary"] = f"{gate.metric} {final:.4f}, max |diff| {worst:.4f} <= {gate.max_abs_diff}: passed{recompiled}"
    return result
