from pathlib import Path

import pytest
import yaml

from tests.conftest import EXAMPLES, quickstart_data
from trnflow.specs import MAX_SPEC_BYTES, MAX_SPEC_VALUES, JobSpec, SpecError, load_spec, parse_spec, validate_spec
from trnflow.workload.recipes import RECIPES


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
        validate_spec(data, "spec.yaml", RECIPES)  # as the command line and the flows check a spec
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
        ({"compute": {"backend": "sagemaker", "max_pending_minutes": 10}}, None, "compute.max_pending_minutes"),
        ({"compute": {"hang_timeout_minutes": 0}}, None, "compute.hang_timeout_minutes"),
        ({"compute": {"hang_timeout_minutes": 1}}, None, "compute.hang_timeout_minutes"),  # below the 120 s collective
    ],
)
def test_bad_values_name_their_field(section, values, path):
    problems = _problems(quickstart_data(**section))
    assert any(p.startswith(path) for p in problems), problems


def test_the_gate_takes_one_band_and_a_metric_its_recipe_declares():
    data = quickstart_data(gate={"metric": "loss", "max_rel_diff": 0.02})
    data["gate"].pop("max_abs_diff", None)
    spec = validate_spec(data, model=RECIPES)
    assert (spec.gate.metric, spec.gate.max_rel_diff) == ("loss", 0.02)
    assert _problems(quickstart_data(gate={"max_abs_diff": 0.01, "max_rel_diff": 0.02})) == [
        "gate.max_rel_diff: max_abs_diff is set too; the gate uses one band, so keep max_abs_diff for an absolute "
        "band or max_rel_diff for a relative one"]
    assert _problems(quickstart_data(gate={"metric": "perplexity"})) == [
        "gate: metric 'perplexity' is not one recipe m5-text supports (accuracy, loss, f1, auc)"]
    assert any(p.startswith("gate.metric:") for p in _problems(quickstart_data(gate={"metric": "Top-1"})))


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


# -- bounded input: what a bad file can cost -----------------------------------------------------

def _billion_laughs() -> str:
    """Nine levels of nine aliases each: a few hundred bytes standing for 9**9 * 9 strings."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def test_a_billion_laughs_document_is_refused_not_expanded(tmp_path):
    path = tmp_path / "laughs.yaml"
    path.write_text(_billion_laughs())
    assert path.stat().st_size < 600
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert str(caught.value).startswith(f"{path}: invalid job spec")
    (problem,) = caught.value.problems
    assert problem.startswith("line ") and "aliases (*name) expand the spec to more than 20,000 values" in problem
    assert "alias expansion refused" in problem and "write the values out" in problem


def test_a_recursive_alias_is_refused():
    with pytest.raises(SpecError) as caught:
        parse_spec("name: &loop [a, *loop]\n", "loop.yaml")
    assert caught.value.problems == ["line 1, column 17: an alias inside the value it names (a recursive alias); "
                                     "a job spec is a tree: write the value out"]


def test_aliases_within_the_bound_still_work():
    text = yaml.safe_dump(quickstart_data(train={"steps": 300, "checkpoint_every": 300}))
    text = text.replace("checkpoint_every: 300", "checkpoint_every: &every 300").replace("steps: 300", "steps: *every")
    assert "*every" in text
    spec = parse_spec(text, "aliases.yaml")
    assert (spec.train.steps, spec.train.checkpoint_every) == (300, 300)


def test_an_oversize_spec_is_refused_before_it_is_parsed(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("name: " + "x" * (2 * MAX_SPEC_BYTES) + "\n")
    size = path.stat().st_size
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert caught.value.source == str(path)
    assert caught.value.problems == [
        f"(file): is {size:,} bytes, more than the 1,048,576 (1 MiB) a job spec may have; a spec names its data "
        "(data.train, ...) rather than holding it: check that this is the spec file"]
    with pytest.raises(SpecError, match=r"huge\.json: invalid job spec\n  \(file\): is 2,097,164 bytes"):
        parse_spec('{"name": "' + "x" * (2 * MAX_SPEC_BYTES) + '"}', "huge.json")  # text from anywhere: the same
    at_the_limit = yaml.safe_dump(quickstart_data()) + "#" * (MAX_SPEC_BYTES - len(yaml.safe_dump(quickstart_data())))
    assert len(at_the_limit.encode()) == MAX_SPEC_BYTES
    assert parse_spec(at_the_limit, "full.yaml").name == "quickstart"


def test_too_many_values_or_too_deep_a_nesting_is_refused():
    with pytest.raises(SpecError) as caught:
        parse_spec("name: [" + "1, " * (MAX_SPEC_VALUES + 1) + "1]\n", "many.yaml")
    (problem,) = caught.value.problems
    assert f"the spec holds more than {MAX_SPEC_VALUES:,} values; a job spec has a few hundred" in problem
    with pytest.raises(SpecError) as caught:
        parse_spec("name: " + "[" * 100 + "]" * 100 + "\n", "deep.yaml")
    assert caught.value.problems == ["line 1, column 70: values nested more than 64 levels deep; a job spec has "
                                     "a few levels"]


def test_every_duplicate_key_is_named_in_file_order():
    text = "name: a\nmodel: {recipe: m5-text, recipe: m5-text}\nname: b\n"
    with pytest.raises(SpecError) as caught:
        parse_spec(text, "dup.yaml")
    assert caught.value.problems == [
        "line 2, column 26: 'recipe' is given twice in the same section; keep one of them",
        "line 3, column 1: 'name' is given twice in the same section; keep one of them"]


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_the_loader_reads_what_yaml_safe_load_reads_with_libyaml_where_installed(path):
    from trnflow.specs.loader import _read_yaml, _SpecLoader

    text = path.read_text() + "extra: [2026-11-25, 0x1f, 1e3, .inf, ~, yes, '007', !!binary aGk=]\n"
    assert _read_yaml(text, path.name) == yaml.safe_load(text)
    if yaml.__with_libyaml__:
        assert yaml.CSafeLoader.__mro__[1] in _SpecLoader.__mro__  # libyaml's parser, not PyYAML's own


def test_a_spec_with_thousands_of_problems_lists_the_first_fifty():
    faults = [{"kind": "bogus", "core": 0}] * 3000
    with pytest.raises(SpecError) as caught:
        validate_spec(quickstart_data(faults=faults), "faults.yaml")
    problems = caught.value.problems
    assert len(problems) == 51 and problems[0].startswith("faults.0.kind: Input should be")
    assert problems[-1] == "(and 2,950 more): not listed; fix these and validate again"


@pytest.mark.slow  # two fresh interpreters, each importing the command line and the flows
def test_what_a_spec_is_checked_for_does_not_depend_on_what_was_imported_first(tmp_path):
    """The command line and the flows pass the recipe's checks to the loader themselves: in a fresh
    interpreter, the answer is the same whether or not the recipes were imported beforehand."""
    import json
    import subprocess
    import sys

    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(quickstart_data(model={"params": {"d_model": 30, "n_heads": 4}})))
    probe = (
        "import json, sys\n"
        "if sys.argv[2] == 'first':\n"
        "    import trnflow.workload.recipes\n"
        "from pathlib import Path\n"
        "from trnflow.specs import SpecError\n"
        "from trnflow.cli.common import checked\n"
        "from trnflow.flows._params import resolve_spec\n"
        "said = []\n"
        "for check in (lambda: checked(Path(sys.argv[1])), lambda: resolve_spec(None, sys.argv[1])):\n"
        "    try:\n"
        "        check(); said.append(None)\n"
        "    except SpecError as exc:\n"
        "        said.append(exc.problems)\n"
        "print(json.dumps(said))\n")
    answers = [json.loads(subprocess.run([sys.executable, "-c", probe, str(spec), order], capture_output=True,
                                         text=True, check=True, timeout=120).stdout)
               for order in ("first", "not")]
    expected = ["model.params.d_model: 30 is not divisible by n_heads (4); pick a width that is a multiple of the "
                "head count"]
    assert answers == [[expected, expected]] * 2


@pytest.mark.parametrize(("uri", "said"), [
    ("ftp://alice:s3cret@mlflow.acme.com", "'ftp://***@mlflow.acme.com' is not an http:// or https:// URL"),
    ("http://alice:s3cret@mlflow.acme.com", "holds credentials; a spec is no place for secrets"),
    ("http://mlflow.acme.com/?token=s3cret", "has a query or fragment"),
    ("arn:aws:sagemaker:us-east-1:1234:mlflow-tracking-server/x", "is not a SageMaker MLflow ARN"),
])
def test_a_tracking_uri_is_a_server_url_without_credentials_or_a_sagemaker_mlflow_arn(uri, said):
    problems = _problems(quickstart_data(tracking={"mlflow_uri": uri}))
    assert len(problems) == 1 and problems[0].startswith("tracking.mlflow_uri: ") and said in problems[0], problems
    assert "s3cret" not in problems[0]  # a password or token is never repeated back
    for good in ("http://127.0.0.1:5000", "https://mlflow.acme.com/team/",
                 "arn:aws:sagemaker:us-east-1:123456789012:mlflow-tracking-server/team-server",
                 "arn:aws:sagemaker:eu-west-1:123456789012:mlflow-app/app-1"):
        spec = validate_spec(quickstart_data(tracking={"mlflow_uri": good, "experiment": "search/m5"}))
        assert spec.tracking.mlflow_uri == good.rstrip("/") and spec.tracking.experiment == "search/m5"
    assert validate_spec(quickstart_data()).tracking.mlflow_uri is None
