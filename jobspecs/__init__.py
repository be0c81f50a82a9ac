"""Job specs: pydantic models for a trnflow job, loaded from YAML."""

from jobspecs.instances import CATALOGUE, InstanceType, instance
from jobspecs.loader import SpecError, apply_overrides, load_spec, parse_spec, validate_spec
from jobspecs.spec import (
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
