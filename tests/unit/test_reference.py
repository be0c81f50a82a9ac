"""The parity reference's spec: the candidate's job in fp32 at the compiler's quickest level."""

from __future__ import annotations

from trnflow.backends.reference import reference_spec
from trnflow.lifecycle.references import auto_folder, on_record, reference_key, reference_url
from trnflow.specs import JobSpec, Layout


def test_the_reference_trains_the_candidates_job_in_fp32_at_optimisation_level_1(make_spec, tmp_path):
    spec = make_spec(compute={"precision": "bf16"}, compile={"optlevel": 2, "fail_on_recompile": True},
                     train={"max_minutes": 30}, gate={"reference": str(tmp_path / "ref" / "metrics.json")})
    ref = reference_spec(spec)

    assert (ref.compute.precision, ref.compile.optlevel) == ("fp32", 1)
    assert ref.compile.recompile_limit is None  # its graphs are not the compile stage's: it compiles them
    assert ref.train.checkpoint_url == (tmp_path / "ref" / "checkpoints").as_uri() and ref.train.max_minutes is None
    # everything else is the candidate's: its model, data, seed, steps, batches and cache
    unchanged = {"compute": {"precision"}, "compile": {"optlevel", "fail_on_recompile", "max_recompiles"},
                 "train": {"checkpoint_url", "max_minutes"}}
    for section, changed in unchanged.items():
        assert getattr(ref, section).model_dump(exclude=changed) == getattr(spec, section).model_dump(exclude=changed)
    assert ref.model_dump(exclude=set(unchanged)) == spec.model_dump(exclude=set(unchanged))


def test_an_automatic_reference_is_kept_by_what_decides_its_numbers(make_spec):
    spec = make_spec(gate={"reference": "auto"})
    folder = auto_folder(spec)
    assert folder == f"{spec.train.checkpoint_url}/_reference/{reference_key(spec)}"
    assert reference_url(spec) == f"{folder}/metrics.json" and not on_record(spec)
    assert reference_spec(spec).train.checkpoint_url == f"{folder}/checkpoints"  # its training, beside it

    def changed(section: str, **fields) -> JobSpec:
        return spec.model_copy(update={section: getattr(spec, section).model_copy(update=fields)})

    same = [changed("compute", precision="bf16"), changed("compile", optlevel=3), spec.model_copy(
        update={"name": "other"}), changed("train", max_minutes=5.0, checkpoint_every=7, log_every=3),
        changed("inference", batch_size=8), changed("gate", max_abs_diff=0.5, reference=None),
        spec.with_layout(Layout(strategy="fsdp", tp=1))]
    assert {reference_key(s) for s in same} == {reference_key(spec)}  # a run's bounds and outputs, not its numbers
    other = [changed("train", steps=spec.train.steps + 1), changed("train", seed=7), changed("gate", eval_every=3),
             changed("compute", cores_per_node=1), changed("gate", metrics=["loss", "f1"])]
    assert len({reference_key(s) for s in other} | {reference_key(spec)}) == len(other) + 1
