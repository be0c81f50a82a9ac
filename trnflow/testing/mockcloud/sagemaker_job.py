"""One SageMaker training job, run the way SageMaker runs it: per attempt, one container per
instance (`algo-1`, `algo-2`, ...) with its own /opt/ml, the `File` channels and the existing
checkpoints copied in first, `<entrypoint> train`, and at the end the output data uploaded as
output.tar.gz and the model directory as model.tar.gz. An internal error is retried within the
job as `RetryStrategy` says; anything else ends it."""

from __future__ import annotations

import io
import json
import tarfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from trnflow.backends.contract import JobEnv
from trnflow.neuron.launch import INSTANCE_CORES_ENV
from trnflow.neuron.runtime import RT_DIR_ENV
from trnflow.specs import instance
from trnflow.storage.s3 import S3Store, split_s3_url
from trnflow.testing.mockcloud.nodes import Node, Notice, container_env, free_port, run_nodes
from trnflow.workload.checkpoint import MARKER

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
CAPACITY_ERROR = ("CapacityError: Unable to provision requested ML compute capacity. Please retry using a different "
                  "ML instance type.")
"""SageMaker's FailureReason for a job none of whose instance types had capacity."""


def download_prefix(s3: Any, url: str, into: Path) -> None:
    store = S3Store(url, client=s3)
    for obj in store.list():
        target = into / obj.name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.read(obj.name))


def committed_checkpoints(s3: Any, url: str) -> int:
    """The training checkpoints committed under the run's folder `url` (`step-*/COMMITTED`; not the
    preflight's round trip, which writes one elsewhere in it and deletes it)."""
    return sum(1 for obj in S3Store(url, client=s3).list("step-") if obj.name.endswith(f"/{MARKER}")
               and obj.name.count("/") == 1)


def tar_gz(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                archive.add(path, arcname=str(path.relative_to(folder)))
    return buffer.getvalue()


class SageMakerJob:
    def __init__(self, cloud: Any, job: Any, body: dict[str, Any]):
        self.cloud, self.job, self.body = cloud, job, body
        self.name = body["TrainingJobName"]
        self.env = body.get("Environment") or {}
        self.phase = self.env.get(JobEnv.var("phase"), "")
        self._stop: str | None = None
        self._began = time.time()
        job.training_job_status, job.secondary_status = "InProgress", "Starting"
        job.secondary_status_transitions = []
        job.training_end_time = None
        self._transition("Starting", "Preparing the instances for training")

    def stop(self, reason: str) -> None:
        self._stop = reason

    def _transition(self, status: str, message: str) -> None:
        now = datetime.now()
        for previous in self.job.secondary_status_transitions:
            previous.setdefault("EndTime", now)
        self.job.secondary_status = status
        self.job.secondary_status_transitions.append({"Status": status, "StartTime": now, "StatusMessage": message})
        self.job.last_modified_time = now

    def run(self) -> None:
        retries = (self.body.get("RetryStrategy") or {}).get("MaximumRetryAttempts", 0)
        spot = bool(self.body.get("EnableManagedSpotTraining"))
        billable, attempt = 0.0, 0
        try:
            while True:
                attempt += 1
                status, reason, seconds = self._attempt(attempt)
                billable += seconds * (1 - self.cloud.spot_discount) if spot else seconds
                if status == "Interrupted":  # managed spot: the job goes on once spot capacity is back
                    self._transition("Interrupted", f"The spot instances were reclaimed ({reason}); the job "
                                     "restarts when spot capacity is available")
                    continue
                if status == "Failed" and reason.startswith("InternalServerError") and attempt <= retries:
                    self._transition("Restarting", f"Retrying the job after: {reason}")
                    continue
                break
        except Exception as exc:  # the emulation itself failed: say so, as the service would
            status, reason = "Failed", f"InternalServerError: the mock cloud could not run the job: {exc!r}"
        self._finish(status, reason, billable)

    def _finish(self, status: str, reason: str, billable: float) -> None:
        job = self.job
        if status == "Failed":
            job.failure_reason = reason
        secondary = "MaxRuntimeExceeded" if reason == "MaxRuntimeExceeded" else status
        self._transition(secondary, reason or "Training job completed")
        job.billable_time_in_seconds = max(1, round(billable))
        job.training_time_in_seconds = max(1, round(time.time() - self._began))
        job.training_end_time = datetime.now()
        job.training_job_status = status

    def _hosts(self) -> list[str]:
        return [f"algo-{i + 1}" for i in range(self.body["ResourceConfig"]["InstanceCount"])]

    def _prepare(self, s3: Any, opt_ml: Path, host: str, hosts: list[str]) -> None:
        """What SageMaker puts in an instance's /opt/ml before the container starts."""
        config = opt_ml / "input" / "config"
        config.mkdir(parents=True, exist_ok=True)
        (config / "resourceconfig.json").write_text(json.dumps({"current_host": host, "hosts": hosts}))
        (config / "hyperparameters.json").write_text(json.dumps(self.body.get("HyperParameters") or {}))
        channels = {c["ChannelName"]: c for c in self.body.get("InputDataConfig") or []}
        (config / "inputdataconfig.json").write_text(json.dumps(
            {name: {"TrainingInputMode": c.get("InputMode", "File")} for name, c in channels.items()}))
        for name, channel in channels.items():
            folder = opt_ml / "input" / "data" / name
            folder.mkdir(parents=True, exist_ok=True)
            if channel.get("InputMode", "File") == "File":  # FastFile is mounted on demand
                download_prefix(s3, channel["DataSource"]["S3DataSource"]["S3Uri"], folder)
        checkpoint = self.body.get("CheckpointConfig")
        if checkpoint:
            local = opt_ml / Path(checkpoint.get("LocalPath", "/opt/ml/checkpoints")).relative_to("/opt/ml")
            local.mkdir(parents=True, exist_ok=True)
            download_prefix(s3, checkpoint["S3Uri"], local)
        (opt_ml / "model").mkdir(exist_ok=True)
        (opt_ml / "output" / "data").mkdir(parents=True, exist_ok=True)

    def _sm_env(self, opt_ml: Path, host: str, hosts: list[str], port: int) -> dict[str, str]:
        """The variables the training toolkit of the Neuron containers sets from /opt/ml."""
        hyper = self.body.get("HyperParameters") or {}
        channels = [c["ChannelName"] for c in self.body.get("InputDataConfig") or []]
        itype = f"ml.{self.itype}"
        env = {
            JobEnv.var("opt_ml"): str(opt_ml), "TRAINING_JOB_NAME": self.name,
            "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": host,
            "SM_HOST_COUNT": str(len(hosts)), "SM_CURRENT_HOST_RANK": str(hosts.index(host)),
            # algo-1 resolves to the first instance in a SageMaker cluster; here every instance is this machine
            "SM_MASTER_ADDR": "127.0.0.1", "SM_MASTER_PORT": str(port),
            "SM_CURRENT_INSTANCE_TYPE": itype, "SM_NUM_NEURONS": str(instance(itype.removeprefix("ml.")).cores),
            "SM_INPUT_DIR": str(opt_ml / "input"), "SM_INPUT_CONFIG_DIR": str(opt_ml / "input" / "config"),
            "SM_INPUT_DATA_DIR": str(opt_ml / "input" / "data"), "SM_MODEL_DIR": str(opt_ml / "model"),
            "SM_OUTPUT_DIR": str(opt_ml / "output"), "SM_OUTPUT_DATA_DIR": str(opt_ml / "output" / "data"),
            "SM_OUTPUT_FAILURE": str(opt_ml / "output" / "failure"),
            "SM_CHANNELS": json.dumps(channels), "SM_HPS": json.dumps(hyper),
        }
        env |= {f"SM_CHANNEL_{c.upper()}": str(opt_ml / "input" / "data" / c) for c in channels}
        env |= {f"SM_HP_{k.upper().replace('-', '_')}": str(v) for k, v in hyper.items()}
        return env

    def _launch(self) -> str | None:
        """The instance type launched: the requested one, or the first of `InstancePreferences` that
        has capacity (recorded as `SelectedInstanceType`, as SageMaker does); None when none has."""
        config = self.job.resource_config
        wanted = [p["InstanceType"] for p in config.get("InstancePreferences") or []] or [config["InstanceType"]]
        for itype in wanted:
            if itype.removeprefix("ml.") not in self.cloud.no_capacity:
                if "InstancePreferences" in config:
                    config["SelectedInstanceType"] = itype
                    config["SelectedInstanceCount"] = config.get("InstanceCount", 1)
                return itype.removeprefix("ml.")
            self._transition("Starting", "Insufficient capacity error from EC2 while launching instances, retrying!")
        return None

    def _attempt(self, attempt: int) -> tuple[str, str, float]:
        fault = self.cloud.take_fault("sagemaker", self.phase, "start")
        if fault is not None:
            return "Failed", fault.reason, 0.0
        itype = self._launch()
        if itype is None:
            return "Failed", CAPACITY_ERROR, 0.0
        self.itype = itype
        s3 = self.cloud.client("s3")
        root = self.cloud.work_dir / "sagemaker" / self.name / f"attempt-{attempt}"
        hosts, port, nodes = self._hosts(), free_port(), []
        if attempt > 1:  # a restart launches its instances anew
            self._transition("Starting", "Launching requested ML instances")
        time.sleep(self.cloud.provision_seconds)
        pulling = time.time()  # SageMaker bills from here (TrainingStartTime): the image and the data
        self._transition("Downloading", "Downloading the training image and input data")
        if self.job.training_start_time is None or attempt == 1:
            self.job.training_start_time = datetime.now()
        time.sleep(self.cloud.image_pull_seconds)
        for host in hosts:
            opt_ml = root / host / "opt" / "ml"
            self._prepare(s3, opt_ml, host, hosts)
            emulator = {INSTANCE_CORES_ENV: str(instance(itype).cores), RT_DIR_ENV: str(root / host / "neuron-rt"),
                        "TRNFLOW_HOME": str(root / host / "trnflow-home")}
            env = container_env(self.cloud.endpoint_url, self.cloud.region, self.env,
                                self._sm_env(opt_ml, host, hosts, port), emulator,
                                self.cloud.node_layer(hosts.index(host), f"{self.name}/{host}"))
            nodes.append(Node(["train"], env, root / host / "container.log", f"{self.name}/{host}-{int(time.time())}"))
        self._transition("Training", "Training image download completed. Training in progress.")
        watch = self._checkpoint_watch(s3)
        limit = self.body.get("StoppingCondition", {}).get("MaxRuntimeInSeconds")
        began = time.time()

        reclaimed: list[str] = []

        def interrupt() -> str | Notice | None:
            if self._stop:  # StopTrainingJob: SIGTERM, and 120 s before SageMaker ends the containers
                return Notice(self._stop, self.cloud.sagemaker_stop_grace_seconds)
            if limit and time.time() - began > limit:
                return "MaxRuntimeExceeded"
            if watch is not None and watch():
                fault = self.cloud.take_fault("sagemaker", self.phase, "checkpoint")
                if fault is not None and fault.spot:
                    reclaimed.append(fault.reason)
                    return Notice(fault.reason, self.cloud.spot_grace_seconds)
                return fault.reason if fault else None
            return None

        codes, reason, seconds = run_nodes(nodes, LOG_GROUP, self.cloud.client("logs"), interrupt)
        seconds += began - pulling  # the download is billed too
        if reclaimed:
            return "Interrupted", reclaimed[0], seconds
        if reason is not None:
            stopped = reason == "MaxRuntimeExceeded" or reason == self._stop
            return ("Stopped" if stopped else "Failed"), reason, seconds
        if all(code == 0 for code in codes):
            self._transition("Uploading", "Uploading generated training model")
            self._upload_outputs(s3, root / hosts[0] / "opt" / "ml")
            return "Completed", "", seconds
        reports = [p.read_text() for p in sorted(root.glob("*/opt/ml/output/failure"))]
        return "Failed", f"AlgorithmError: {reports[0] if reports else f'exit codes {codes}'}", seconds

    def _checkpoint_watch(self, s3: Any) -> Any:
        """When a fault waits for a new checkpoint: a function telling whether one was committed."""
        url = self.env.get("TRNFLOW_CHECKPOINT_S3_URI")
        if not url or not self.cloud.pending_fault("sagemaker", self.phase, "checkpoint"):
            return None
        before = committed_checkpoints(s3, url)
        return lambda: committed_checkpoints(s3, url) > before

    def _upload_outputs(self, s3: Any, opt_ml: Path) -> None:
        bucket, prefix = split_s3_url(f"{self.body['OutputDataConfig']['S3OutputPath'].rstrip('/')}/{self.name}")
        for folder, name in ((opt_ml / "output" / "data", "output/output.tar.gz"), (opt_ml / "model",
                                                                                   "output/model.tar.gz")):
            s3.put_object(Bucket=bucket, Key=f"{prefix.rstrip('/')}/{name}", Body=tar_gz(folder))
