"""The cloud job's contract, written once: the `TRNFLOW_*` variables the orchestrator gives every
SageMaker and Batch job (`JobEnv`, built by `trnflow.backends.cloud`, read by the container,
`trnflow.backends.container`), and the files a job's nodes and the orchestrator leave each other
under the job's output folder (`JobOutputs`)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

PREFIX = "TRNFLOW_"


class JobEnv(BaseModel):
    """What a cloud job is told through its environment. Each field is the variable `TRNFLOW_<FIELD>`
    (upper case); `to_env` writes them, `from_env` reads them back, checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: str = Field(description="the phase, or phases run in turn on the same instances (`sanity+train`)")
    run_id: str = Field(description="the run, which names its checkpoint folder")
    spec_url: str | None = Field(None, description="where the job's spec is (SageMaker's `spec` channel wins)")
    nproc_per_node: int = Field(ge=1, description="worker processes on each node: one per NeuronCore it uses")
    checkpoint_s3_uri: str | None = Field(None, description="where the run's checkpoints are")
    result_url: str | None = Field(None, description="where each job's nodes leave their files, under <job id>/")
    proceed_timeout_seconds: float = Field(1800.0, gt=0, description="how long nodes wait between phases for the "
                                           "orchestrator's word")
    checkpoint: str | None = Field(None, description="the checkpoint evaluate and infer read")
    spot: bool = Field(False, description="a spot job: on Batch the container watches for EC2's reclaim notice")
    budget_usd: float | None = Field(None, ge=0, description="what the job's training may cost, in US dollars at "
                                     "on-demand prices (`JobRequest.budget_usd`); a later phase of the job gets its "
                                     "own with the orchestrator's word (`Proceed.budget_usd`)")
    recipe_modules: bool = Field(False, description="the spec may name its recipe by module (as where it was "
                                 "submitted)")
    # Set by no orchestrator: where a rehearsal (the mock cloud) moves what the services fix.
    opt_ml: Path = Field(Path("/opt/ml"), description="SageMaker's /opt/ml, moved as a bind mount would")
    master_port: int = Field(41000, ge=1, le=65535, description="torchrun's rendezvous port between Batch nodes "
                             "(the port the Neuron Batch samples use)")
    output_dir: Path = Field(Path("/tmp/trnflow-output"),  # noqa: S108 (the container's own)
                             description="where a Batch node's ranks write their results")

    def to_env(self) -> dict[str, str]:
        """The variables, leaving out those that say nothing (unset, false, or the default)."""
        out = {}
        for name, value in self.model_dump(exclude_defaults=True).items():
            if value is None or value is False:
                continue
            text = "1" if value is True else f"{value:.12g}" if isinstance(value, float) else str(value)
            out[PREFIX + name.upper()] = text
        return out

    @classmethod
    def var(cls, field: str) -> str:
        """The variable that carries `field` (`phase`: `TRNFLOW_PHASE`)."""
        if field not in cls.model_fields:
            raise KeyError(f"{field}: not a field of the job's contract")
        return PREFIX + field.upper()

    @classmethod
    def from_env(cls, env: dict[str, str]) -> JobEnv:
        """The contract from a job's environment (other variables are the services' own), checked:
        a variable that is missing or malformed fails the job naming it."""
        return cls.model_validate({name: env[cls.var(name)] for name in cls.model_fields if cls.var(name) in env})

    @classmethod
    def one(cls, env: dict[str, str], field: str) -> Any:
        """One field from a job's environment, or its default: for what is read before the whole
        contract is (the rendezvous, where a rehearsal moves SageMaker's folders)."""
        raw = env.get(cls.var(field))
        if raw is None:
            return cls.model_fields[field].default
        return TypeAdapter(cls.model_fields[field].annotation).validate_python(raw)


class JobOutputs:
    """The names of the files under a job's output folder (`<result_url>/<job id>/`): who writes
    each, and who reads it."""

    NODE_FAILURES = "failure-node"
    NODE_FAILURE = re.compile(r"failure-node(\d+)\.json")
    """A node's root failure, which its container uploads when it fails."""
    HOSTS = "hosts/"
    """Each node of each attempt says who it is, when it starts."""
    PHASES = "phases/"

    @staticmethod
    def node_failure(node: int) -> str:
        return f"failure-node{node}.json"

    @staticmethod
    def phase_result(phase: str) -> str:
        """The main node's result of a phase that ended in a job running several, once it passed."""
        return f"phases/{phase}.json"

    @staticmethod
    def placement(attempt: int, round_: int) -> str:
        """The main node's placement of healthy cores for a preflight round."""
        return f"phases/placement-{attempt}-{round_}.json"

    @staticmethod
    def proceed(phase: str) -> str:
        """The orchestrator's word on whether the nodes go on to `phase`."""
        return f"proceed-{phase}.json"

    @staticmethod
    def host(attempt: int, node: int) -> str:
        return f"hosts/attempt{attempt}/node{node}.json"
