"""The specs room (`trnflow.specs`, kept in the repository's jobspecs/ folder): what a job is.

It owns the pydantic job spec (every field described, unknown fields refused), the YAML loader with
its clear errors, the instance catalogue, and the example specs. It is the lowest room: it imports
nothing else of trnflow.
"""

from trnflow.specs.instances import CATALOGUE, InstanceType, instance
from trnflow.specs.loader import (
    MAX_SPEC_BYTES,
    MAX_SPEC_VALUES,
    SpecError,
    apply_overrides,
    load_spec,
    parse_spec,
    validate_spec,
)
from trnflow.specs.runs import PREFLIGHT_FOLDER, RETRAINED, new_run_id, run_id_problem
from trnflow.specs.spec import (
    HOST_RESERVED_MEMORY_GIB,
    CompileSpec,
    ComputeSpec,
    DataSpec,
    FaultSpec,
    GateSpec,
    GenerateSpec,
    InferenceSpec,
    JobSpec,
    Layout,
    ModelSpec,
    PreflightSpec,
    RetrySpec,
    ScheduleSpec,
    TrainSpec,
    container_memory_limit_gib,
    is_module_reference,
    memory_problem,
    sagemaker_checkpoint_problem,
    tracking_uri,
)

__all__ = [
    "CATALOGUE",
    "HOST_RESERVED_MEMORY_GIB",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_VALUES",
    "PREFLIGHT_FOLDER",
    "RETRAINED",
    "CompileSpec",
    "ComputeSpec",
    "DataSpec",
    "FaultSpec",
    "GateSpec",
    "GenerateSpec",
    "InferenceSpec",
    "InstanceType",
    "JobSpec",
    "Layout",
    "ModelSpec",
    "PreflightSpec",
    "RetrySpec",
    "ScheduleSpec",
    "SpecError",
    "TrainSpec",
    "apply_overrides",
    "container_memory_limit_gib",
    "instance",
    "is_module_reference",
    "load_spec",
    "memory_problem",
    "new_run_id",
    "parse_spec",
    "run_id_problem",
    "sagemaker_checkpoint_problem",
    "tracking_uri",
    "validate_spec",
]
