"""The specs room (`trnflow.specs`, kept in the repository's jobspecs/ folder): what a job is.

It owns the pydantic job spec (every field described, unknown fields refused), the YAML loader with
its clear errors, the instance catalogue, and the example specs. It is the lowest room: it imports
nothing else of trnflow.
"""

from trnflow.specs.instances import CATALOGUE, InstanceType, instance
from trnflow.specs.loader import SpecError, apply_overrides, load_spec, parse_spec, validate_spec
from trnflow.specs.spec import (
    CompileSpec,
    ComputeSpec,
    DataSpec,
    FaultSpec,
    GateSpec,
    InferenceSpec,
    JobSpec,
    ModelSpec,
    PreflightSpec,
    RetrySpec,
    ScheduleSpec,
    TrainSpec,
)

__all__ = [
    "CATALOGUE",
    "CompileSpec",
    "ComputeSpec",
    "DataSpec",
    "FaultSpec",
    "GateSpec",
    "InferenceSpec",
    "InstanceType",
    "JobSpec",
    "ModelSpec",
    "PreflightSpec",
    "RetrySpec",
    "ScheduleSpec",
    "SpecError",
    "TrainSpec",
    "apply_overrides",
    "instance",
    "load_spec",
    "parse_spec",
    "validate_spec",
]
