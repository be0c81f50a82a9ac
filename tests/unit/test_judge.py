"""The gate's decision and registration, called directly: a rerun of the same run registers nothing twice."""

import json

from trnflow.lifecycle.judge import Candidate, Registration, register, up_to
from trnflow.lifecycle.registry import Registry


def test_a_rerun_of_the_same_run_reuses_its_version_and_does_not_promote_again(make_spec, tmp_path):
    spec = make_spec()
    ckpt = tmp_path / "ckpt" / "run" / "step-000040"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"watermark": "2026-01-02", "global_step": 40, "parent": None}))
    registry = Registry(spec.registry_url)
    candidate = Candidate(ckpt.as_uri(), {"points": [{"step": 40, "accuracy": 0.8}]})
    first = register(spec, registry, candidate, "run", {"passed": True}, registry.generation(spec.name))
    again = register(spec, registry, candidate, "run", {"passed": True}, registry.generation(spec.name))
    assert first == Registration(version=1, promoted=True, generation=0)
    assert again == Registration(version=1, promoted=False, generation=1, registered_before=True)
    assert again.as_dict() == {"version": 1, "promoted": False, "generation": 1, "registered_before": True}
    assert len(registry.versions(spec.name)) == 1 and len(registry.history(spec.name)) == 1


def test_an_older_checkpoint_is_gated_on_its_own_points():
    series = {"points": [{"step": 20, "accuracy": 0.7}, {"step": 40, "accuracy": 0.8}],
              "predictions": {"step": 40, "correct": "01"}}
    at_20 = up_to(series, 20)
    assert [p["step"] for p in at_20["points"]] == [20] and "predictions" not in at_20
    assert up_to(series, 40) == series
