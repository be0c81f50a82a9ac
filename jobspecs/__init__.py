"""Job specs: pydantic models for a trnflow job, loaded from YAML."""

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
