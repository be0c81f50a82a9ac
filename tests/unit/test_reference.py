"""The parity reference's spec: the candidate's job in fp32 at the compiler's quickest level."""

from __future__ import annotations

from trnflow.backends.reference import reference_spec


def test_the_reference_trains_the_candidates_job_in_fp32_at_optimisation_level_1(make_spec, tmp_path):
    spec = make_spec(compute={"precision": "bf16"}, compile={"optlevel": 2},
                     train={"max_minutes": 30}, gate={"reference": str(tmp_path / "ref" / "metrics.json")})
    ref = reference_spec(spec)

    assert (ref.compute.precision, ref.compile.optlevel) == ("fp32", 1)
    assert ref.train.checkpoint_url == (tmp_path / "ref" / "checkpoints").as_uri() and ref.train.max_minutes is None
    # everything else is the candidate's: its model, data, seed, steps, batches and cache
    unchanged = {"compute": {"precision"}, "compile": {"optlevel"}, "train": {"checkpoint_url", "max_minutes"}}
    for section, changed in unchanged.items():
        assert getattr(ref, section).model_dump(exclude=changed) == getattr(spec, section).model_dump(exclude=changed)
    assert ref.model_dump(exclude=set(unchanged)) == spec.model_dump(exclude=set(unchanged))
