"""A property-based fuzz of the spec loader: whatever text or structure it is given, it returns a
JobSpec or raises SpecError with at least one `where: what` problem; it never crashes otherwise."""

import copy

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import EXAMPLES
from trnflow.specs import JobSpec, SpecError, parse_spec, validate_spec

QUICKSTART = yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=30), st.sampled_from(["s3://", "file://", "gs://b/k", "-1", "1e309", "~", ""]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=8)


def _outcome(load):
    try:
        return load()
    except SpecError as exc:
        assert exc.problems and all(isinstance(p, str) and ": " in p for p in exc.problems), exc.problems
        return exc


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for key, child in node.items():
            yield (*prefix, key)
            yield from _paths(child, (*prefix, key))


PATHS = sorted(_paths(QUICKSTART))


@FUZZ
@given(st.text(max_size=400))
def test_any_text_is_a_spec_or_a_clean_error(text):
    result = _outcome(lambda: parse_spec(text, "fuzz.yaml"))
    assert isinstance(result, JobSpec | SpecError)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(PATHS), values), min_size=1, max_size=4))
def test_the_quickstart_with_any_fields_replaced_is_a_spec_or_a_clean_error(replacements):
    data = copy.deepcopy(QUICKSTART)
    for path, value in replacements:
        node = data
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                break
            node = node[key]
        else:
            node[path[-1]] = value
    result = _outcome(lambda: validate_spec(data, "fuzz.yaml"))
    assert isinstance(result, JobSpec | SpecError)


@FUZZ
@given(values)
def test_any_structure_is_a_spec_or_a_clean_error(data):
    result = _outcome(lambda: validate_spec(data, "fuzz.yaml"))
    assert isinstance(result, SpecError)  # nothing random is a whole job spec
