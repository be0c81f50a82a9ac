from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLES, quickstart_data
from trnflow.specs import JobSpec, SpecError, load_spec, validate_spec


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_spec_is_valid(path):
    spec = load_spec(path)
    assert spec.name
    assert spec.train.global_batch_size % spec.compute.world_size == 0


def test_examples_include_quickstart_and_trn1_32xl():
    names = {p.name for p in EXAMPLES.glob("*.yaml")}
    assert {"quickstart.yaml", "trn1-32xl-incremental.yaml"} <= names


def _problems(data) -> list[str]:
    with pytest.raises(SpecError) as info:
        validate_spec(data, "spec.yaml")
    return info.value.problems


def test_unknown_field_wrong_type_and_impossible_cores_are_all_named():
    data = quickstart_data(model={"params": {"colour": "blue"}}, train={"steps": "many"},
                           compute={"cores_per_node": 32})
    problems = _problems(data)
    text = "\n".join(problems)
    assert any(p.startswith("model.params.colour: Extra inputs are not permitted") for p in problems), text
    assert any(p.startswith("train.steps:") for p in problems), text
    assert (
        "compute.cores_per_node: trn1.2xlarge has 2 NeuronCores; set compute.cores_per_node <= 2 "
        "or pick trn1.32xlarge" in problems
    ), text


def test_batch_must_divide_across_cores_and_the_fix_is_named():
    problems = _problems(quickstart_data(train={"global_batch_size": 33}))
    assert problems == [
        "train.global_batch_size: 33 is not divisible by the 2 NeuronCores "
        "(compute.nodes x compute.cores_per_node); use 32"
    ]


def test_multi_node_needs_efa():
    problems = _problems(quickstart_data(compute={"nodes": 2}))
    assert problems[0].startswith("compute.nodes: trn1.2xlarge has no EFA for multi-node training")


@pytest.mark.parametrize(
    ("section", "values", "path"),
    [
        ({"data": {"train": "http://example.com/x"}}, None, "data.train"),
        ({"data": {"format": "xml"}}, None, "data.format"),
        ({"compute": {"precision": "fp16"}}, None, "compute.precision"),
        ({"compute": {"instance_type": "p4d.24xlarge"}}, None, "compute.instance_type"),
        ({"train": {"steps": -5}}, None, "train.steps"),
        ({"gate": {"max_abs_diff": 0}}, None, "gate.max_abs_diff"),
        ({"model": {"params": {"d_model": 66, "n_heads": 4}}}, None, "model.params.d_model"),
        ({"schedule": {"cron": "every day"}}, None, "schedule.cron"),
        ({"name": "Bad Name!"}, None, "name"),
        ({"compile": {"optlevel": 4}}, None, "compile.optlevel"),
    ],
)
def test_bad_values_name_their_field(section, values, path):
    problems = _problems(quickstart_data(**section))
    assert any(p.startswith(path) for p in problems), problems


def test_missing_required_section():
    data = quickstart_data()
    del data["train"]
    assert _problems(data) == ["train: required field is missing"]


def test_relative_paths_become_absolute_file_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = validate_spec(quickstart_data())
    assert spec.data.train == (tmp_path / "runs/quickstart/data/train").as_uri()
    assert spec.train.checkpoint_url.startswith("file:///")


def test_s3_urls_are_kept_and_bad_buckets_refused():
    spec = validate_spec(quickstart_data(compile={"cache_url": "s3://my-bucket/neuron-cache"}))
    assert spec.compile.cache_url == "s3://my-bucket/neuron-cache"
    problems = _problems(quickstart_data(compile={"cache_url": "s3://"}))
    assert problems[0].startswith("compile.cache_url:")


def test_malformed_yaml_reports_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel:\n  d_model: [1, 2\n")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert info.value.problems[0].startswith("line ")
    assert "malformed YAML" in info.value.problems[0]


def test_yaml_tags_are_not_executed(tmp_path):
    bad = tmp_path / "evil.yaml"
    bad.write_text("name: !!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(SpecError) as info:
        load_spec(bad)
    assert "malformed YAML" in info.value.problems[0]


def test_missing_file_and_non_mapping(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path / "nope.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(SpecError, match="expected a mapping"):
        load_spec(listing)


def test_overrides_apply_dotted_paths(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(yaml.safe_dump(quickstart_data()))
    spec = load_spec(path, {"train.steps": 7, "compute.precision": "bf16"})
    assert (spec.train.steps, spec.compute.precision) == (7, "bf16")


def test_every_field_is_described():
    def walk(schema, defs, where):
        for name, prop in schema.get("properties", {}).items():
            assert prop.get("description"), f"{where}.{name} has no description"
        for ref_name, sub in defs.items():
            if sub.get("type") == "object":
                for name, prop in sub.get("properties", {}).items():
                    assert prop.get("description"), f"{ref_name}.{name} has no description"

    schema = JobSpec.model_json_schema()
    walk(schema, schema.get("$defs", {}), "JobSpec")


def test_digest_ignores_formatting(tmp_path):
    a = validate_spec(quickstart_data())
    b = JobSpec.model_validate_json(a.model_dump_json())
    assert a.digest() == b.digest()
    assert a.digest() != validate_spec(quickstart_data(train={"steps": 301})).digest()


def test_spec_files_stay_untouched_by_loading(tmp_path):
    path = tmp_path / "q.yaml"
    text = yaml.safe_dump(quickstart_data())
    path.write_text(text)
    load_spec(path, {"train.steps": 3})
    assert Path(path).read_text() == text
