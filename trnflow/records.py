"""The files one room writes and another reads back, as types: a checkpoint's `meta.json` (written by
training, read by resuming, evaluation, inference and the gate's registration) and the gate's verdict
(`verdict.json`, the evaluate stage's result, the registry entry and the CLI's notes).

Each file is read through `read(model, data, origin)`, which refuses a malformed copy with a
`DataError` naming the file and the field, so a writer and its readers cannot drift apart
unnoticed. Unknown fields are refused too: a file written by another version of trnflow is named as
such rather than half understood.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from trnflow.errors import DataError


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


R = TypeVar("R", bound=BaseModel)


class RecipeRef(Record):
    """Which recipe made a model, at which version and with which params: what a checkpoint, an
    export, a registry entry and a training result say of it (`Recipe.describe`)."""

    recipe: str = Field(description="the recipe's name (model.recipe)")
    version: str = Field(description="its version, part of every compile-cache key")
    params: dict[str, Any] = Field(default_factory=dict, description="its params, as the recipe read them")

    def label(self) -> str:
        """`m5-text@1 {"d_model": 64, ...}`."""
        return f"{self.recipe}@{self.version} {json.dumps(self.params, sort_keys=True)}"


def problems(exc: ValidationError) -> str:
    """A validation error's problems, each as `field: what is wrong`."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(the whole file)'}: {e['msg']}"
                     for e in exc.errors(include_url=False))


class RecordError(DataError):
    """A file that is not the record it should be: `origin` names it, `problem` says which field."""

    def __init__(self, origin: str, problem: str, fix: str):
        super().__init__(f"{origin}: {problem}; {fix}")
        self.origin, self.problem = origin, problem


DAMAGED = "the file is damaged, or was written by another version of trnflow"


def read(model: type[R], data: bytes | str | dict[str, Any], origin: str, fix: str = DAMAGED) -> R:
    """`data` (JSON text, or already parsed) as `model`; a RecordError naming `origin` and the bad
    field, then `fix` (what to do)."""
    try:
        parsed = json.loads(data) if isinstance(data, bytes | str) else data
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(origin, f"not JSON ({exc})", fix) from None
    try:
        return model.model_validate(parsed)
    except ValidationError as exc:
        raise RecordError(origin, f"not a {model.__name__} ({problems(exc)})", fix) from None


def dump(record: BaseModel) -> bytes:
    """A record as the JSON file it is stored as."""
    return record.model_dump_json(indent=2, exclude_none=False).encode()


# --- a run's curves: the training loss, and the holdout's metrics ----------------------------

class CurvePoint(Record):
    """A point of the training curve: the mean loss over the steps since the point before."""

    step: int = Field(ge=0, description="this run's steps done")
    global_step: int = Field(ge=0, description="the model's steps over its lineage (its ancestors' and this run's)")
    loss: float = Field(description="the mean training loss since the point before (rank 0's share of each batch)")
    samples_per_s: float = Field(0.0, ge=0, description="samples a second since the point before")
    graphs: int = Field(0, ge=0, description="graphs the run's compile backend had met by then")


class Rollback(Record):
    """A divergence a run healed (train.on_divergence: rollback): the step whose batch it skipped,
    why, the checkpoint it went back to, and the samples of that batch."""

    step: int = Field(ge=1, description="the diverged step, whose batch is skipped")
    reason: str = Field(description="what diverged: the loss, the rule and the rank")
    restored_from: int = Field(ge=0, description="the step of the checkpoint training went back to")
    samples: list[int] = Field(default_factory=list, description="the skipped batch's rows (their indices in the "
                               "training rows as read), every replica's")

    def __str__(self) -> str:
        return (f"step {self.step} ({self.reason}): back to step {self.restored_from}, "
                f"{len(self.samples)} samples skipped")


class RollbackLog(Record):
    """A run's `rollbacks.json`, beside its checkpoints: every step it skipped after a divergence, so
    that an attempt resuming from before one skips it too."""

    rollbacks: list[Rollback] = Field(default_factory=list)


STEP_KEYS = ("step", "global_step", "rows")
"""A metric point's fields besides its metrics' values."""


class MetricPoint(BaseModel):
    """One evaluation of the holdout: each metric's value at a step. Stored flat, as a metrics file
    holds its points (`{"step": 300, "global_step": 300, "accuracy": 0.79, "loss": 0.45, "rows": 500}`);
    a point from another platform's file may lack `global_step` (it is then the step) and `rows`,
    and its fields that are not numbers (a timestamp, a name) are not metrics and are left out."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    step: int = Field(ge=0, description="this run's steps done")
    global_step: int = Field(ge=0, description="the model's steps over its lineage")
    rows: int | None = Field(None, ge=0, description="holdout rows evaluated")
    values: dict[str, float] = Field(description="each metric's value, by the metric's name")

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "values" in data:
            return data
        values = {k: v for k, v in data.items() if k not in STEP_KEYS
                  and isinstance(v, int | float) and not isinstance(v, bool)}
        flat = {k: data[k] for k in STEP_KEYS if k in data}
        return {"global_step": flat.get("step"), **flat, "values": values}

    @model_serializer(mode="wrap")
    def _flat(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        values = data.pop("values")
        if data.get("rows") is None:
            data.pop("rows", None)
        return {**data, **values}

    def value(self, metric: str) -> float:
        """The value of `metric`; KeyError when it was not measured."""
        return self.values[metric]


class Predictions(Record):
    """Per holdout row, in holdout order, '1' when the model predicted it right: at one step (or
    `final`: at each model's own last step, when two runs on different data are paired)."""

    step: int | Literal["final"]
    correct: str = Field(pattern=r"^[01]*$")


class MetricSeries(BaseModel):
    """A metric series, as a metrics file holds it (`trnflow.lifecycle.gate`): a run's `metrics.json`,
    or another platform's file. Other top-level fields of such a file are not the gate's, and are
    left out."""

    model_config = ConfigDict(extra="ignore")

    format: int = 1
    source: str | None = Field(None, description="what measured it: a run id, or a platform's name")
    points: list[MetricPoint] = Field(default_factory=list, description="the evaluations, by step")
    holdout_sha256: str | None = Field(None, description="the holdout the points were measured on")
    directions: dict[str, Literal["higher", "lower"]] = Field(
        default_factory=dict, description="which way each metric is better (a trnflow run's series says)")
    predictions: Predictions | None = Field(None, description="the per-row outcomes at one step")
    checkpoint: str | None = Field(None, description="the checkpoint it was measured on (an fp32 reference's)")

    @property
    def last(self) -> MetricPoint:
        return self.points[-1]

    def steps(self) -> list[int]:
        return [p.step for p in self.points]


# --- a checkpoint's meta.json ----------------------------------------------------------------

class DataRead(Record):
    """The training data a run read: exactly these files, so a retry resumes on the same rows."""

    files: list[str] = Field(default_factory=list, description="the files read, relative to data.train")
    partitions: list[str] = Field(default_factory=list, description="their dt=YYYY-MM-DD day partitions")
    watermark: str | None = Field(None, description="the newest day partition read")
    rows: int = Field(0, description="rows read")


CHECKPOINT_MARKER = "COMMITTED"
"""The file a checkpoint's folder gets last, listing every file of it with its checksum: a folder
without it is not a checkpoint (`trnflow.workload.checkpoint`)."""


def manifest_digest(listed: dict[str, Any]) -> str:
    """The digest of what a marker (`COMMITTED`, `EXPORTED`) lists: each file's name, sha256 and size,
    in name order. Equal digests mean the same files with the same contents, once each file has been
    checked against the marker; the registry records it for each version (`Digests`)."""
    lines = "".join(f"{name}\t{entry['sha256']}\t{entry.get('size', '')}\n" for name, entry in sorted(listed.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


class TrainTime(Record):
    """Where a run's training time went, along the attempts that led to a checkpoint (a checkpoint's,
    and the final weights' in the train result): the steps whose work the weights hold, and what the
    loop lost beside them. Rank 0's clock."""

    steps_seconds: float = Field(0.0, ge=0, description="the steps whose work the weights hold, each once (an "
                                 "attempt's first step, which loads or compiles its graphs, at its second's time)")
    stall_seconds: float = Field(0.0, ge=0, description="what checkpoints stopped training for, and what the steps "
                                 "a write in the background shared the host with took, together, over as many "
                                 "means of recent steps that ran alone")
    rollback_seconds: float = Field(0.0, ge=0, description="divergences rolled back: the steps undone and the "
                                    "restores")
    slow_seconds: float = Field(0.0, ge=0, description="what the ranks waited for ranks named slow: their own "
                                "work over their peers' median, a step at a time")
    eval_seconds: float = Field(0.0, ge=0, description="the holdout evaluated during training (the gate's "
                                "points before the last step)")


class CheckpointMeta(Record):
    """A checkpoint's `meta.json`: where the run stands, where the model came from, what it read."""

    run_id: str = Field(description="the training run that wrote it")
    step: int = Field(description="steps of this run done")
    saved_at: float | None = Field(None, description="when it was written (Unix seconds)")
    parent: str | None = Field(None, description="the checkpoint this run started from (train.init_from)")
    lineage: list[str] = Field(default_factory=list, description="its ancestors' checkpoints, nearest first")
    base_step: int = Field(0, description="the global step this run started at (its ancestors' steps)")
    global_step: int = Field(description="base_step + step")
    spec_digest: str = Field(description="the digest of the spec the run was trained with")
    precision: str = Field(description="compute.precision")
    world_size: int = Field(description="ranks that trained")
    loss: float | None = Field(None, description="the loss of the last step (None when not finite)")
    sampler: dict[str, int] = Field(description="the sampler's position, checked on resume (rows, batch, seed)")
    data: DataRead = Field(description="the training data read")
    watermark: str | None = Field(None, description="the newest day partition this model has seen")
    metrics: list[CurvePoint] = Field(default_factory=list, description="the training curve so far")
    evaluations: list[MetricPoint] = Field(default_factory=list, description="holdout points so far")
    holdout_sha256: str | None = Field(None, description="the holdout the evaluations were measured on")
    recipe: RecipeRef = Field(description="the model's recipe: name, version and params")
    torch: str = Field(description="the PyTorch version that wrote it")
    export: str | None = Field(None, description="the model exported in its own library's format (last step only)")
    base: str | None = Field(None, description="the content digest of the frozen base its adapters were trained on "
                             "(LoRA): the checkpoint holds only the weights that train")
    parallelism: str = Field("ddp", description="how the run spread the model over its cores (ddp, fsdp); the "
                             "checkpoint holds it whole either way, and resumes at any world size")
    tp: int = Field(1, ge=1, description="the cores each layer was split over (train.parallelism.tp); a run resumes "
                    "at any tp")
    time: TrainTime = Field(default_factory=TrainTime, description="where the training time up to it went")


# --- the gate's verdict ----------------------------------------------------------------------

class PairedCheck(Record):
    """McNemar's paired test of two models on the same holdout rows, or why it could not run."""

    available: bool = Field(description="both sides had per-row outcomes on the same holdout, at the same step")
    reason: str | None = Field(None, description="why it could not run")
    step: int | str | None = Field(None, description="the step compared ('final': each model's last)")
    rows: int = 0
    both_right: int = 0
    candidate_only: int = Field(0, description="rows only the candidate got right")
    reference_only: int = Field(0, description="rows only the reference got right")
    both_wrong: int = 0
    p_value: float = 1.0
    alpha: float = 0.05
    significant: bool = False
    rows_needed: int = Field(0, description="holdout rows the test needs to see a difference the size of the band")
    underpowered: bool = False


class VerdictPoint(Record):
    """One evaluation step both series have."""

    step: int
    global_step: int
    candidate: float
    reference: float
    diff: float = Field(description="candidate - reference")
    passed: bool


EXPORT_MARKER = "EXPORTED"
"""The marker an export folder is complete with, written last."""


class ExportedFile(Record):
    sha256: str
    size: int


ADAPTER_FOLDER = "adapter"
"""Where a LoRA run's export keeps the adapter alone, in PEFT's format, beside the merged model."""


class ExportMarker(Record):
    """`EXPORTED`, in a run's `export/step-NNNNNN/` folder: what the recipe exported (its name,
    version and params) and every file of the export with its checksum."""

    recipe: RecipeRef
    files: dict[str, ExportedFile]
    base: str | None = Field(None, description="LoRA: the content digest of the pretrained folder the adapter "
                             "(adapter/) needs; the merged model beside it needs nothing")


class Band(Record):
    """How far a candidate's metric may be from its reference's, and which way the metric is better."""

    metric: str
    max_abs_diff: float | None = Field(description="the largest difference allowed (None: max_rel_diff is)")
    max_rel_diff: float | None = Field(None, description="when set, the allowed difference is this share of the "
                                       "reference's value")
    better: Literal["higher", "lower"] = Field("higher", description="which way the metric is better")

    def allowed(self, reference: float) -> float:
        """The largest difference allowed from a reference value."""
        if self.max_rel_diff is not None:
            return self.max_rel_diff * abs(reference)
        assert self.max_abs_diff is not None, "a band is absolute or relative"
        return self.max_abs_diff

    def regression(self, diff: float) -> float:
        """How much worse a candidate `diff` (candidate - reference) away is: positive when worse."""
        return -diff if self.better == "higher" else diff

    @property
    def text(self) -> str:
        """The band in words: `±0.001`, or `±1% of the reference`."""
        return f"±{self.max_rel_diff * 100:g}% of the reference" if self.max_rel_diff is not None \
            else f"±{self.max_abs_diff:g}"


class Verdict(Band):
    """The gate's verdict within its band: every matched point, the paired test and, for several
    checks, each one's."""

    mode: str = Field(description="every-point, final or no-regression")
    passed: bool
    points: list[VerdictPoint] = Field(default_factory=list)
    paired: PairedCheck | None = None
    reason: str | None = Field(None, description="why it failed, or why there was nothing to compare")
    checks: dict[str, Verdict] = Field(default_factory=dict, description="each check by what it was against, when "
                                       "the candidate was judged more than once")

    def each(self) -> dict[str, Verdict]:
        """Each check by what it was against ('' for the one check of a single verdict)."""
        return self.checks or {"": self}
