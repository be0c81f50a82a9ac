"""The spec's operational sections: schedule (the retraining cron), tracking (MLflow and
TensorBoard), preflight (the hardware and collective checks) and faults (rehearsals)."""

from __future__ import annotations

import re
import zoneinfo
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, model_validator

from trnflow.redact import without_credentials
from trnflow.specs.fields import MAX_STEPS, Section
from trnflow.teams import is_loopback


class ScheduleSpec(Section):
    """When scheduled incremental retraining runs."""

    cron: str = Field(
        description="Five-field cron expression, for example '0 3 * * *'. Read by scheduled retraining; "
        "`trnflow run` runs at once and ignores it."
    )
    timezone: str = Field("UTC", description="IANA time zone for the cron expression.")

    @model_validator(mode="after")
    def _five_fields(self) -> ScheduleSpec:
        fields = self.cron.split()
        if len(fields) != 5:
            raise ValueError(f"schedule.cron: {self.cron!r} must have 5 fields (minute hour day month weekday)")
        for text, (name, low, high, names) in zip(fields, _CRON_FIELDS, strict=True):
            problem = _cron_field_problem(text, low, high, names)
            if problem:
                raise ValueError(f"schedule.cron: {self.cron!r}: the {name} field {text!r} {problem}; "
                                 f"it takes {low}-{high}, *, lists (a,b), ranges (a-b) and steps (*/n)")
        try:
            zoneinfo.ZoneInfo(self.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder such as "Europe"
            raise ValueError(f"schedule.timezone: {self.timezone!r} is not an IANA time zone; use for example "
                             "UTC or Europe/Paris") from None
        return self


_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
_CRON_FIELDS = (("minute", 0, 59, ()), ("hour", 0, 23, ()), ("day", 1, 31, ()), ("month", 1, 12, _MONTHS),
                ("weekday", 0, 7, _DAYS))


def _cron_field_problem(text: str, low: int, high: int, names: tuple[str, ...]) -> str | None:
    """What is wrong with one cron field, or None."""
    if any(sign in text.upper() for sign in "LW#?"):
        return None  # last day, nearest weekday, n-th weekday, no value: the scheduler checks those
    for item in text.split(","):
        span, _, step = item.partition("/")
        if step and not (step.isdigit() and int(step) >= 1):
            return f"has step {step!r}, not a positive number"
        if span == "*":
            continue
        for bound in span.split("-", 1):
            value = names.index(bound.lower()) + (low if names is _MONTHS else 0) if bound.lower() in names else (
                int(bound) if bound.isdigit() else None)
            if value is None:
                return f"has {bound!r}, which is not a number"
            if not low <= value <= high:
                return f"has {value}, outside {low}-{high}"
    return None


MLFLOW_ARN = re.compile(r"^arn:aws[a-z-]*:sagemaker:[a-z0-9-]+:[0-9]{12}:mlflow-(app|tracking-server)/"
                        r"[A-Za-z0-9](-*[A-Za-z0-9]){0,255}$")
"""A SageMaker managed MLflow tracking server's (or MLflow app's) ARN, as SageMaker's API writes it."""


def tracking_uri(value: str) -> str:
    """An MLflow server's http(s) URL without credentials, or a SageMaker managed MLflow ARN."""
    if value.startswith("arn:"):
        if not MLFLOW_ARN.match(value):
            raise ValueError(f"{value!r} is not a SageMaker MLflow ARN (arn:aws:sagemaker:REGION:ACCOUNT:"
                             "mlflow-tracking-server/NAME, or mlflow-app/NAME)")
        return value
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018  # raises on a port that is not a number
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{without_credentials(value)!r} is not an http:// or https:// URL of an MLflow server, "
                         "nor a SageMaker MLflow ARN; for a local one, `trnflow tracking server` prints its URL")
    if parts.username or parts.password:
        raise ValueError("holds credentials; a spec is no place for secrets: give them to the orchestrator's "
                         "environment as MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                         "MLFLOW_TRACKING_TOKEN), and write the URL without them")
    if parts.query or parts.fragment:  # not repeated: it may hold a token
        raise ValueError("has a query or fragment; write the server's base URL (a token goes in the orchestrator's "
                         "environment as MLFLOW_TRACKING_TOKEN)")
    if parts.scheme == "http" and not is_loopback(value):
        raise ValueError(f"{value!r} is plain http on another machine: its credentials and every run's metrics "
                         "would cross the network in the clear; use https (plain http only on loopback)")
    return value.rstrip("/")


class TrackingSpec(Section):
    """Where each run is mirrored for experiment tracking, besides trnflow's own records (which stay
    the source of truth): an MLflow server, and TensorBoard event files."""

    mlflow_uri: Annotated[str, AfterValidator(tracking_uri)] | None = Field(
        None, description="The MLflow tracking server each run is mirrored to: http(s)://HOST[:PORT][/PATH] (no "
        "credentials: MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN in the orchestrator's "
        "environment), or a SageMaker managed MLflow ARN (arn:aws:sagemaker:REGION:ACCOUNT:mlflow-tracking-server/"
        "NAME or mlflow-app/NAME; needs the sagemaker-mlflow plugin: pip install 'trnflow[mlflow]'). None: no MLflow. "
        "Each pipeline run is mirrored there when it ends, by the orchestrator (jobs need no path to it); one it "
        "cannot reach is kept for `trnflow tracking sync` and never fails the run.")
    experiment: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_./-]{1,256}$",
        description="The MLflow experiment runs are recorded in (letters, digits, - _ . /); default: the spec's name.")
    tensorboard: bool = Field(
        False, description="Write each run's step metrics (training loss, learning rate, samples/s, the candidate's "
        "and the reference's holdout metrics, the gate's difference) as TensorBoard event files under "
        "`<train.checkpoint_url>/<run id>/tensorboard/` when the run ends: `tensorboard --logdir "
        "<train.checkpoint_url>` shows every run (an s3:// folder is read by TensorBoard with boto3).")


class PreflightSpec(Section):
    """Hardware sanity and collective tests that gate a run before any training starts."""

    exclude_bad_cores: bool = Field(
        False, description="Go on without cores that fail the sanity tests, if enough healthy ones remain: other "
        "cores are checked, then used (on SageMaker and Batch, other cores of the same instances; an instance "
        "without enough healthy ones is replaced, and the preflight runs again on the new one)."
    )
    min_busbw_gbps: float | None = Field(
        None, ge=0, le=1_000_000,
        description="Fail preflight when the all-reduce bus bandwidth (GB/s) falls below this."
    )
    max_latency_us: float | None = Field(
        None, gt=0, le=3.6e9, description="Fail preflight when the smallest all-reduce takes longer than this (us)."
    )
    collective_timeout_seconds: float = Field(
        120.0, gt=0, le=3600, description="A collective that does not complete in this time is reported as hung."
    )
    checkpoint_round_trip: bool = Field(
        True, description="Before training, write a checkpoint of the spec's model and optimizer shapes where the "
        "run's checkpoints go (`<checkpoint_url>/<run id>/_preflight/`), read it back, compare it and delete it: a "
        "location that cannot take a checkpoint fails the preflight, not the first save an interval into training."
    )


class FaultSpec(Section):
    """A fault to inject, to rehearse how the pipeline copes (the TRNFLOW_FAULTS variable adds more)."""

    kind: Literal["corrupt", "hang", "memory", "slow", "kill", "timeout", "hw", "nan", "spike", "stall",
                  "freeze", "torn"] = Field(
        description="corrupt: wrong results from the core's engines; hang: the core stalls in a collective; "
        "memory: the core's memory pattern test fails; slow: each training step's own work takes the core three times "
        "as long (a throttled host). Once per run at `step`: kill: the rank is killed with SIGKILL; timeout: an "
        "execution timeout; hw: an uncorrectable hardware error; nan: the step's result turns to NaN; spike: the "
        "step's loss comes back a thousandfold (a loss spike); stall: the rank stops making progress (a device that "
        "never returns; its own watchdog notices); freeze: the rank's process stops whole, its watchdog included (a "
        "host that stopped answering: only its peers can notice); torn: the rank is killed halfway through writing "
        "its next checkpoint or inference shard."
    )
    core: int = Field(ge=0, le=1023, description="The NeuronCore id the fault hits.")
    step: int | None = Field(
        None, ge=1, le=MAX_STEPS,
        description="When a kill, timeout, hw, nan, spike, stall, freeze or torn fault strikes (required for "
        "those): the training step, or in inference the rank's n-th shard."
    )
    phase: Literal["train", "infer"] | None = Field(
        None, description="Strike only in this phase (default: once in each, training and inference)."
    )

    @model_validator(mode="after")
    def _step_for_training_faults(self) -> FaultSpec:
        training = self.kind in ("kill", "timeout", "hw", "nan", "spike", "stall", "freeze", "torn")
        if training and self.step is None:
            raise ValueError(f"faults: a {self.kind} fault needs `step`, the step it strikes at")
        if not training and (self.step is not None or self.phase is not None):
            raise ValueError(f"faults: a {self.kind} fault is a property of the core; remove `step` and `phase`")
        return self
