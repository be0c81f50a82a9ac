"""Experiment tracking: each run mirrored where teams already compare runs (an MLflow tracking
server, `tracking.mlflow_uri`), from what the orchestrator holds. trnflow's own records (the
registry, the metric series, the stage results) stay the source of truth; the mirror never decides
anything, and a server that is down or refuses never fails a run.

One pipeline run is one MLflow run, named by trnflow's run id (a rerun with the same id goes on
in the same MLflow run): the spec flattened as parameters; the training curve, the candidate's
holdout metrics, the reference's gate metric and the gate's difference by step; inference's and
the run's totals; lineage as tags; the run's summary, outcome and parity chart as artifacts. What could not
be sent is kept (`<TRNFLOW_HOME>/tracking/<run id>.json`) for `trnflow tracking sync RUN`.

A SageMaker managed MLflow server is named by its ARN and reached through the `sagemaker-mlflow`
plugin, which signs each request with the orchestrator's AWS credentials.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trnflow.fsutil import atomic_write_text
from trnflow.lifecycle.registry import Registry
from trnflow.records import read
from trnflow.redact import without_credentials
from trnflow.results import EvaluateResult, InferResult, RunOutcome, TrainResult
from trnflow.specs import JobSpec, tracking_uri
from trnflow.storage import open_store
from trnflow.teams import Team

HEALTH_TIMEOUT_SECONDS = 5.0
REQUEST_TIMEOUT_SECONDS = 10
"""Each request to the tracking server, at most (no retries): a server that is down costs a run seconds."""
PLUGIN = "sagemaker_mlflow"
PARAM_LIMIT = 6000  # MLflow's longest parameter value
CREDENTIALS = ("TOKEN", "USERNAME", "PASSWORD")
"""The MLflow client's credential variables are `MLFLOW_TRACKING_<these>`."""
FILE_NAME = r"^[\w][\w.-]{0,127}$"
"""A file the mirror writes or names (an artifact, an image): one plain name, no folder."""


class TrackedMetric(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str
    value: float
    step: int


class TrackedVersion(BaseModel):
    """A registered version as MLflow's model registry gets it: by reference (the registry entry,
    which names the checkpoint and its digests), never the weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    version: int = Field(description="trnflow's version number (the MLflow version's trnflow.version tag)")
    checkpoint: str
    status: str = Field(description="the gate's decision")
    entry: str = Field(description="the registry entry, JSON")


class TrackedRun(BaseModel):
    """What one run sends to MLflow: built from the run's typed results, kept as JSON when the
    server cannot take it."""

    model_config = ConfigDict(extra="forbid")

    uri: str = Field(description="the tracking server (tracking.mlflow_uri)")
    experiment: str
    run_id: str = Field(description="trnflow's run id: the MLflow run's name and its trnflow.run_id tag")
    finished: bool = Field(description="the run completed (MLflow FINISHED), else FAILED")
    params: dict[str, str] = Field(default_factory=dict)
    tags: dict[str, str] = Field(default_factory=dict)
    metrics: list[TrackedMetric] = Field(default_factory=list)
    artifacts: dict[str, str] = Field(default_factory=dict, description="text files by name")
    images: dict[str, str] = Field(default_factory=dict, description="PNG files by name, base64")
    registered: TrackedVersion | None = Field(None, description="the version the run registered")
    champion: int | None = Field(None, description="the registry's champion when the run ended: the MLflow "
                                 "model's `champion` alias follows it")

    @field_validator("uri")
    @classmethod
    def _server(cls, value: str) -> str:
        return tracking_uri(value)  # as a spec's: a kept run read back is checked again

    @field_validator("artifacts", "images")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(FILE_NAME, name):
                raise ValueError(f"{name!r} is not a plain file name (letters, digits, `_.-`; no folder)")
        return value


def is_sagemaker_arn(uri: str) -> bool:
    return uri.startswith("arn:")


def server_problem(uri: str, timeout: float = HEALTH_TIMEOUT_SECONDS) -> tuple[str | None, str | None]:
    """Whether the MLflow server at `uri` answers: a problem line (`tracking.mlflow_uri: ...`), or a
    note on what could not be checked from here; (None, None) when it answered."""
    if is_sagemaker_arn(uri):
        if importlib.util.find_spec(PLUGIN) is None:
            return ("tracking.mlflow_uri: a SageMaker MLflow ARN needs the sagemaker-mlflow plugin, which is not "
                    "installed here: pip install 'trnflow[mlflow]'"), None
        return None, ("tracking.mlflow_uri: a SageMaker MLflow server, reached with the orchestrator's AWS "
                      "credentials when a run starts; not asked now")
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=timeout) as answer:  # noqa: S310  # http(s) only
            if answer.status == 200:
                return None, None
            said = f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        said = f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:  # refused, unknown host, timed out
        said = str(getattr(exc, "reason", exc))
    return (f"tracking.mlflow_uri: no MLflow server answers at {uri} ({said}); start one (`trnflow tracking "
            "server` for a local one) or correct the URL"), None


# --- what a run sends ---------------------------------------------------------------------------


def _flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flat(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip("."), tree


def _param(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, list | dict) else str(value)
    return without_credentials(text)[:PARAM_LIMIT]


def _version() -> str:
    try:
        return importlib.metadata.version("trnflow")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def step_metrics(spec: JobSpec, outcome: RunOutcome) -> list[TrackedMetric]:
    """The run's metrics by step (MLflow's and TensorBoard's): the training curve and learning
    rate, the candidate's holdout metrics, the reference's gate metric and the gate's difference,
    the verdict, inference's and the run's totals (at step 0)."""
    metrics: list[TrackedMetric] = []

    def add(key: str, value: Any, step: int = 0) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            metrics.append(TrackedMetric(key=key, value=float(value), step=step))

    train = outcome.results.get("train")
    if isinstance(train, TrainResult):
        for point in train.curve:
            add("train/loss", point.loss, point.step)
            add("train/lr", spec.train.lr, point.step)  # constant: trnflow has no schedule
            add("train/samples_per_s", point.samples_per_s, point.step)
    evaluated = outcome.results.get("evaluate")
    if isinstance(evaluated, EvaluateResult):
        for point in evaluated.points:
            for key, value in [*point.values.items(), *([("rows", point.rows)] if point.rows is not None else [])]:
                add(f"eval/{key}", value, point.step)
        verdict = evaluated.verdict
        if verdict is not None:
            for vp in verdict.points:
                add(f"reference/{verdict.metric}", vp.reference, vp.step)
                add("gate/diff", vp.diff, vp.step)
            add("gate/passed", 1.0 if verdict.passed else 0.0)
            if verdict.points:
                add("gate/largest_abs_diff", max(abs(vp.diff) for vp in verdict.points))
    inferred = outcome.results.get("infer")
    if isinstance(inferred, InferResult):
        add("infer/rows", inferred.rows)
        add("infer/rows_per_s", inferred.rows_per_s)
    if outcome.cost.total_usd is not None:
        add("cost/total_usd", outcome.cost.total_usd)
    add("cost/instance_hours", round(sum(r.billable_seconds * r.nodes for r in outcome.cost.rows) / 3600, 6))
    if (good := outcome.cost.goodput) is not None:
        add("goodput/fraction", good.fraction)
        add("goodput/training_s", good.training_seconds)
        for name, seconds in good.losses:
            add(f"goodput/lost_{name}_s", seconds)
        add("goodput/final_eval_s", good.final_eval_seconds)
    return metrics


CHECKOUT = Path(__file__).resolve().parents[2]  # the repository's root, when trnflow runs from one


def _commit(checkout: Path = CHECKOUT) -> str | None:
    """The git commit trnflow runs from, when it runs from its own checkout (an installed wheel has
    none; a wheel installed inside another project's repository is not that project's commit)."""
    if not (checkout / ".git").exists() or not (checkout / "trnflow" / "reporting" / "tracking.py").is_file():
        return None
    try:
        said = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"],
                              capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return said.stdout.strip() or None


def _registered(spec: JobSpec, evaluated: Any) -> tuple[TrackedVersion | None, int | None]:
    """The version this run registered, as MLflow gets it, and the registry's champion now."""
    if not (spec.registry_url and isinstance(evaluated, EvaluateResult) and evaluated.registry):
        return None, None
    registry = Registry(spec.registry_url)
    number = evaluated.registry.version
    entry = registry.version(spec.name, number).entry
    champion = registry.champion(spec.name)
    return (TrackedVersion(model=spec.name, version=number, checkpoint=without_credentials(entry.checkpoint),
                           status=entry.status or "", entry=entry.model_dump_json(indent=1)),
            champion.version if champion else None)


def tracked_run(spec: JobSpec, outcome: RunOutcome, ended: str | None, summary: str,
                flow_run_url: str | None = None) -> TrackedRun:
    """The MLflow run of one pipeline run, from its outcome (however it ended: `ended` says how, or
    None when it completed) and its summary text."""
    assert spec.tracking.mlflow_uri is not None and outcome.run_id is not None
    params = {key: _param(value) for key, value in _flat(spec.model_dump(mode="json", exclude={"faults"}))
              if value is not None}
    tags = {"trnflow.run_id": outcome.run_id, "trnflow.spec": spec.name, "trnflow.spec_digest": spec.digest(),
            "trnflow.version": _version(), "trnflow.commit": _commit() or "", "trnflow.state": ended or "Completed"}
    train = outcome.results.get("train")
    if isinstance(train, TrainResult):
        tags |= {"trnflow.checkpoint": train.checkpoint or "", "trnflow.watermark": train.watermark or "",
                 "trnflow.days_read": str(len(train.partitions)), "trnflow.started_from": train.parent or "",
                 "trnflow.steps_trained": str(train.steps_trained)}
        if train.compile is not None:
            tags["trnflow.compile_cache_hits"] = str(train.compile.hits)
    evaluated = outcome.results.get("evaluate")
    if isinstance(evaluated, EvaluateResult):
        verdict = evaluated.verdict
        if verdict is not None:
            tags["trnflow.gate"] = "passed" if verdict.passed else f"failed: {verdict.reason or ''}"[:5000]
        if evaluated.registry:
            tags["trnflow.registry_version"] = str(evaluated.registry.version)
    for row in outcome.stages:  # each stage: its state, time, device and key figure
        took = f" in {row.seconds:.1f} s" if row.seconds is not None else ""
        on = f" on {row.device}" if row.device else ""
        key = f"trnflow.stage.{row.stage}"
        key += "" if key not in tags else f".{sum(k.startswith(key) for k in tags) + 1}"  # a stage run again
        tags[key] = f"{row.state}{took}{on}: {row.summary}"[:5000]
    if outcome.waited_seconds or outcome.preemptions:  # its time in the queue, and the times it yielded
        tags |= {"trnflow.queue_wait_s": f"{outcome.waited_seconds:.1f}", "trnflow.preemptions": str(
            outcome.preemptions)}
    registered, champion = _registered(spec, evaluated)
    if flow_run_url:
        tags["trnflow.flow_run"] = flow_run_url
    artifacts = {"summary.md": summary, "outcome.json": outcome.model_dump_json(indent=1)}
    images = {}
    if isinstance(evaluated, EvaluateResult) and evaluated.chart:  # the chart the evaluate stage drew
        folder, _, name = evaluated.chart.rpartition("/")
        with contextlib.suppress(Exception):  # a chart that cannot be read (a store's own errors) is left out
            images[name] = base64.b64encode(open_store(folder).read(name)).decode()
    return TrackedRun(uri=spec.tracking.mlflow_uri, experiment=spec.tracking.experiment or spec.name,
                      run_id=outcome.run_id, finished=ended is None, params=params,
                      tags={k: v for k, v in tags.items() if v}, metrics=step_metrics(spec, outcome),
                      artifacts=artifacts, images=images, registered=registered, champion=champion)


# --- sending it ------------------------------------------------------------------------------------


HEADER_LOGGER = "mlflow.tracking.request_header.registry"


def credentials(uri: str, team: Team) -> dict[str, str | None]:
    """The MLflow client's credential variables for requests to `uri`: the team's own
    (`<team.mlflow_credentials>_TOKEN`, ...) when `uri` is the team's server (same scheme, host and
    port), else none at all, whatever the orchestrator's environment holds."""
    ours = team.serves(uri)
    return {f"MLFLOW_TRACKING_{name}": os.environ.get(f"{team.mlflow_credentials}_{name}") if ours else None
            for name in CREDENTIALS}


def withheld(uri: str, team: Team) -> str:
    """A note for a run's summary when this machine holds MLflow credentials and `uri` gets none (it
    is not the team's server): what to set if it should. Empty otherwise."""
    if is_sagemaker_arn(uri) or any(credentials(uri, team).values()):
        return ""
    held = sorted({f"{start}_{name}" for start in ("MLFLOW_TRACKING", team.mlflow_credentials)
                   for name in CREDENTIALS if os.environ.get(f"{start}_{name}")})
    if not held:
        return ""
    fix = ("set TRNFLOW_MLFLOW_URI to it if it is this machine's server" if team.unrestricted else
           "the operators name each team's server in the teams file")
    return (f" ({', '.join(held)} not sent: {uri} is not team {team.name}'s tracking server "
            f"({team.mlflow_uri or 'none named'}); {fix})")


@contextlib.contextmanager
def _bounded(uri: str, team: Team) -> Iterator[None]:
    """The MLflow client's requests to `uri`, each cut off after REQUEST_TIMEOUT_SECONDS and never
    retried, with `team`'s credentials only if `uri` is its server (`credentials`). The
    sagemaker-mlflow plugin signs and routes a request by the process's tracking URI, not the
    client's, so that is `uri` too meanwhile; for a server that is not SageMaker's, the plugin's
    failure to read an ARN from it (a warning per request) is not logged."""
    values: dict[str, str | None] = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(REQUEST_TIMEOUT_SECONDS), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # a --json command's stdout is its JSON
        **credentials(uri, team)}
    saved = {k: os.environ.get(k) for k in values}
    headers = logging.getLogger(HEADER_LOGGER)
    level = headers.level
    _put(values)
    if not is_sagemaker_arn(uri):
        headers.setLevel(logging.ERROR)
    try:
        yield
    finally:
        headers.setLevel(level)
        _put(saved)


def _put(values: dict[str, str | None]) -> None:
    """Set each variable, removing those whose value is None."""
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run_url(uri: str, experiment_id: str, mlflow_id: str) -> str | None:
    """Where MLflow's UI shows a run (None for a SageMaker server, whose UI is opened from Studio)."""
    return None if is_sagemaker_arn(uri) else f"{uri}/#/experiments/{experiment_id}/runs/{mlflow_id}"


def send(run: TrackedRun, team: Team) -> tuple[str, str | None]:
    """Send `run` to its server (with `team`'s credentials if it is the team's): the MLflow run's
    id, and its page in MLflow's UI. Raises what the client raises."""
    from mlflow import MlflowClient  # optional (the mlflow extra), and heavy: ~1.5 s
    from mlflow.entities import Metric, Param, RunTag

    with _bounded(run.uri, team):
        client = MlflowClient(run.uri)
        experiment = client.get_experiment_by_name(run.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(run.experiment)
        found = client.search_runs([experiment_id], filter_string=f"tags.`trnflow.run_id` = '{run.run_id}'",
                                   max_results=1)
        mlflow_id = found[0].info.run_id if found else client.create_run(experiment_id, run_name=run.run_id).info.run_id
        now = int(time.time() * 1000)
        if found:  # a rerun of the same trnflow run: its series start again from what this run logged
            known = found[0].data.params
            params = [Param(k, v) for k, v in run.params.items() if k not in known]
        else:
            params = [Param(k, v) for k, v in run.params.items()]
        for part in _chunks(params, 100):
            client.log_batch(mlflow_id, params=part)
        for part in _chunks([RunTag(k, v) for k, v in run.tags.items()], 100):
            client.log_batch(mlflow_id, tags=part)
        for part in _chunks([Metric(m.key, m.value, now, m.step) for m in run.metrics], 1000):
            client.log_batch(mlflow_id, metrics=part)
        for name, text in run.artifacts.items():
            client.log_text(mlflow_id, text, name)
        with tempfile.TemporaryDirectory(prefix="trnflow-tracking-") as tmp:
            for name, data in run.images.items():
                (Path(tmp) / name).write_bytes(base64.b64decode(data))
                client.log_artifact(mlflow_id, str(Path(tmp) / name))
        if run.registered is not None:
            _register(client, mlflow_id, run.registered)
            _point_alias(client, run.registered.model, run.champion)
        client.set_terminated(mlflow_id, status="FINISHED" if run.finished else "FAILED")
    return mlflow_id, run_url(run.uri, experiment_id, mlflow_id)


ALIAS = "champion"
AWAIT_VERSION_SECONDS = 10


def _mirrored(client: Any, model: str, version: int) -> str | None:
    """The MLflow version that mirrors trnflow's `version` of `model`, if any."""
    found = client.search_model_versions(f"name = '{model}' and tags.`trnflow.version` = '{version}'")
    return min((v.version for v in found), key=int, default=None)


def _register(client: Any, mlflow_id: str, registered: TrackedVersion) -> None:
    """Mirror a registered version as an MLflow model version (once), its source the run's
    `registry/vN/` artifact: the registry entry that names the checkpoint."""
    from mlflow.exceptions import MlflowException  # optional, and loaded already by send

    folder = f"registry/v{registered.version:06d}"
    client.log_text(mlflow_id, registered.entry, f"{folder}/entry.json")
    try:
        client.get_registered_model(registered.model)
    except MlflowException:  # not there yet (the client says so only by its error)
        client.create_registered_model(registered.model, description="mirrored from trnflow's registry, which "
                                       "stays the source of truth; each version names its checkpoint")
    if _mirrored(client, registered.model, registered.version) is None:
        client.create_model_version(
            registered.model, f"runs:/{mlflow_id}/{folder}", run_id=mlflow_id,
            tags={"trnflow.version": str(registered.version), "trnflow.checkpoint": registered.checkpoint,
                  "trnflow.status": registered.status},
            description=f"trnflow v{registered.version} (by reference): {registered.checkpoint}",
            await_creation_for=AWAIT_VERSION_SECONDS)


def _point_alias(client: Any, model: str, champion: int | None) -> str:
    """Point the `champion` alias at the MLflow version mirroring trnflow's champion; with no
    champion, or one that was never mirrored, the alias is removed (a stale alias would name a
    model that is no longer the champion). What it did, as a line."""
    from mlflow.exceptions import MlflowException  # optional, and loaded already by the caller

    target = _mirrored(client, model, champion) if champion is not None else None
    if target is not None:
        client.set_registered_model_alias(model, ALIAS, target)
        return f"MLflow's {model}@{ALIAS} is version {target} (trnflow v{champion})"
    with contextlib.suppress(MlflowException):  # no alias to remove
        client.delete_registered_model_alias(model, ALIAS)
    return (f"MLflow's {model}@{ALIAS} removed: trnflow's champion "
            + (f"v{champion} was never mirrored there" if champion is not None else "is none"))


def point_champion(uri: str, model: str, champion: int | None, team: Team) -> str:
    """After a change of champion: move the `champion` alias of `model` on `uri`. A line saying what
    it did or why it could not (never raises: the registry's change stands either way)."""
    try:
        from mlflow import MlflowClient  # optional (the mlflow extra), and heavy

        with _bounded(uri, team):
            return _point_alias(MlflowClient(uri), model, champion)
    except Exception as exc:  # down, refusing, or no mlflow here: trnflow's registry is the source of truth
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return (f"MLflow's {model}@{ALIAS} on {uri} not moved ({why}); the next run mirrored there moves it, "
                "or change the champion again")


def outbox(home: Path, run_id: str) -> Path:
    """Where a run that could not be sent is kept."""
    return home / "tracking" / f"{run_id}.json"


def mirror(spec: JobSpec, outcome: RunOutcome, ended: str | None, summary: str, flow_run_url: str | None,
           home: Path, team: Team) -> tuple[bool, str]:
    """Send the run (`tracked_run`) with `team`'s credentials if its server is the team's, or keep it
    for `trnflow tracking sync`: whether it was sent, and a line for the run's summary saying where
    it went or why not. Never raises."""
    try:
        run = tracked_run(spec, outcome, ended, summary, flow_run_url)
    except Exception as exc:  # a result the mirror cannot read must not cost the run its summary
        return False, f"tracking: nothing sent, the run could not be read for it ({type(exc).__name__}: {exc})"
    kept = outbox(home, run.run_id)
    try:
        mlflow_id, url = send(run, team)
    except Exception as exc:  # down, refusing, or a plugin missing: the run goes on; what was missed is kept
        atomic_write_text(kept, run.model_dump_json())
        why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return False, (f"tracking: not sent to {run.uri} ({why}); kept in {kept}: `trnflow tracking sync "
                       f"{run.run_id}` sends it{withheld(run.uri, team)}")
    kept.unlink(missing_ok=True)  # an earlier attempt's, now sent with the rest
    return True, (f"tracking: MLflow run {mlflow_id}" + (f" ({url})" if url else f" on {run.uri}")
                  + withheld(run.uri, team))


def kept_run(home: Path, run_id: str) -> TrackedRun:
    """What a run kept (`mirror`), checked as it is read (its server's URL, its file names):
    FileNotFoundError when nothing is kept, DataError naming the file when it is not a kept run."""
    kept = outbox(home, run_id)
    return read(TrackedRun, kept.read_bytes(), str(kept))


def sync(home: Path, run: TrackedRun, team: Team) -> tuple[str, str | None]:
    """Send a kept run (`kept_run`), with `team`'s credentials if its server is the team's: the
    MLflow run's id and page. The client's error when it still cannot be sent (it stays kept)."""
    sent = send(run, team)
    outbox(home, run.run_id).unlink()
    return sent
