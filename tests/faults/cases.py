"""The fault cases: what each one breaks, and how the run around it goes."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.faults.world import EVERY, World
from trnflow.workload.checkpoint import MARKER, step_name

HOST_LOST = "Host EC2 (instance i-0d4c3b2a10f9e8d7c) terminated."



@dataclass
class Run:
    """One case's spec and environment, and how to run the flow (once, or killed and run again)."""

    world: World
    folder: Path
    out: str
    sections: dict[str, Any]
    run_id: str
    env: dict[str, str] = field(default_factory=dict)
    reruns: int = 0
    bad_hosts: dict[str, str] = field(default_factory=dict)
    """On a cloud backend: the instances that took the case's host faults."""

    @property
    def spec(self):
        return self.world.spec(self.out, **self.sections)

    def flow(self):
        from trnflow.flows.pipeline import pipeline

        return pipeline(self.spec, run_id=self.run_id, return_state=True)

    def checkpoint_dir(self, step: int) -> Path:
        return Path(self.out) / "checkpoints" / self.run_id / step_name(step)


Setup = Callable[[Run], contextlib.AbstractContextManager]


@dataclass
class Case:
    name: str
    what: str
    sections: dict[str, Any] = field(default_factory=dict)
    setup: Setup | None = None
    """Arranges the fault around the flow (a watcher, a mount, moto); may rerun the flow itself."""
    storage: str = "local"
    interruptions: int = 1
    """Training interruptions the case causes: each may redo at most one checkpoint interval."""
    seen: Callable[[dict], bool] | None = None
    """Whether a case's report shows its fault struck (default: a training attempt per interruption),
    so that a fault that never fired cannot pass as recovered."""
    ci: bool = False
    """The case `make test` runs: the matrix's cases take about a minute each."""
    node_faults: dict[int, str] = field(default_factory=dict)
    """On a cloud backend: device faults of one node (by node index) instead of the service's fault."""
    host_faults: dict[int, str] = field(default_factory=dict)
    """On a cloud backend: device faults of the first instance serving a node (by node index), which a
    replacement instance does not have, instead of the service's fault."""
    no_capacity: set[str] = field(default_factory=set)
    """On a cloud backend: instance types the service has no capacity for, instead of its fault."""
    fault: str | None = None
    """On a cloud backend, instead of its usual fault: `spot`, a spot reclaim of the training job (the
    case's compute section makes it a spot spec)."""
    baseline: str = "ddp"
    """The fault-free run it is compared with, whose layout it runs too (`World.layout`): `ddp`;
    `fsdp`, sharded; `tp`, a decoder's layers split over the two cores; `skip-25`, told to skip
    step 25's batch."""
    rtol: float = 0.0
    """How far its weights, metrics and embeddings may be from the fault-free run's, relative to each
    tensor's largest magnitude: 0, bitwise; a case that reshards onto fewer cores sums its gradients
    in another order."""
    outputs_rtol: float | None = None
    """How far its embeddings may be, where that differs from `rtol`: a case whose inference runs on
    fewer cores than the fault-free run's batches the rows differently, which some CPUs' kernels
    round differently (AMD EPYC's: 2.9e-6 where weights and metrics agree within 1e-6)."""


def _faults(*faults: dict) -> dict:
    return {"faults": list(faults)}


# --- faults that need more than a line in the spec ---------------------------------------------


def _wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _training_job(run: Run) -> Path:
    from trnflow.settings import TrnflowSettings

    for record in TrnflowSettings().jobs_dir.glob("*/job.json"):
        job = json.loads(record.read_text())
        if job["phase"] == "train" and job["run_id"] == run.run_id and not (record.parent / "exit.json").exists():
            return record.parent
    raise LookupError(f"no running training job of run {run.run_id}")


@contextlib.contextmanager
def kill_process_group(run: Run) -> Iterator[None]:
    """SIGKILL the training job's whole process group (supervisor, torchrun and every rank) as
    soon as the step-10 checkpoint is committed."""

    failed: list[BaseException] = []

    def strike() -> None:
        try:
            _wait_for(run.checkpoint_dir(EVERY) / MARKER)
            pid = json.loads((_training_job(run) / "pid.json").read_text())["pid"]
            os.killpg(pid, signal.SIGKILL)
        except BaseException as exc:  # told after the run: the fault never struck
            failed.append(exc)

    watcher = threading.Thread(target=strike, daemon=True)
    watcher.start()
    yield
    watcher.join(timeout=5)
    if failed:
        raise RuntimeError(f"the process group was never killed: {failed[0]}")


def _cli(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("trnflow")), *args]


@contextlib.contextmanager
def kill_flow_process(run: Run) -> Iterator[None]:
    """Run the flow as `trnflow run` in its own process, SIGKILL that process once the step-10
    checkpoint is committed, then let the case run the flow again with the same run id."""
    from prefect.settings import PREFECT_API_URL

    spec_file = run.folder / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(run.spec.model_dump(mode="json"), sort_keys=False))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    with open(run.folder / "killed-flow.log", "wb") as log:
        flow = subprocess.Popen(_cli("run", str(spec_file), "--run-id", run.run_id), env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            _wait_for(run.checkpoint_dir(EVERY) / MARKER)
            job = _training_job(run)
            flow.send_signal(signal.SIGKILL)
        finally:
            flow.kill()
            flow.wait()
    _wait_for(job / "exit.json", timeout=30)  # the orphaned job ends with its flow, freeing its cores
    run.reruns += 1
    yield


@contextlib.contextmanager
def corrupt_cache_entry(run: Run) -> Iterator[None]:
    """A copy of the warm compile cache with one compiled artifact cut short."""
    cache = run.folder / "compile-cache"
    shutil.copytree(run.world.compile_cache, cache)
    neff = sorted(cache.rglob("model.neff"))[0]
    neff.write_bytes(neff.read_bytes()[: neff.stat().st_size // 3])
    run.sections["compile"] = {"cache_url": str(cache)}
    yield


@contextlib.contextmanager
def disk_full(run: Run) -> Iterator[None]:
    """Checkpoints on a tmpfs with room for two and a half of them: the step-30 save fails with
    ENOSPC. The operator then makes room (a larger tmpfs) and runs the flow again."""
    disk = run.folder / "disk"
    disk.mkdir()
    folders = (run.world.root / "baseline" / "checkpoints").rglob("step-*")
    one = max(sum(p.stat().st_size for p in folder.iterdir()) for folder in folders)  # one checkpoint's size
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(one * 2.5)}", "tmpfs", str(disk)], check=True,
                   capture_output=True)
    try:
        run.sections["train"] = {"checkpoint_url": str(disk / "checkpoints")}
        state = run.flow()
        failure = str(state.result(raise_on_failure=False))
        if state.is_completed() or "DiskFull" not in failure:
            raise AssertionError(f"the disk did not fill as planned: {state.name}: {failure}")
        subprocess.run(["mount", "-o", "remount,size=256m", str(disk)], check=True)  # the operator's fix
        run.reruns += 1
        yield
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, capture_output=True)


@functools.cache
def can_mount() -> bool:
    """Whether this process may mount a tmpfs (root, with the capability to mount)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    with tempfile.TemporaryDirectory() as probe:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", probe], capture_output=True).returncode:
            return False
        subprocess.run(["umount", probe], capture_output=True)
    return True


def _api_retries(row: dict) -> bool:
    return row["retries_by"].get("api", 0) > 0


# --- the matrix ----------------------------------------------------------------------------------

CASES = [
    Case("rank-sigkill", "a rank SIGKILLed at step 15",
         _faults({"kind": "kill", "core": 1, "step": 15, "phase": "train"})),
    Case("process-group-kill", "training's whole process group SIGKILLed after the step-10 checkpoint",
         setup=kill_process_group),
    Case("flow-process-kill", "the flow process SIGKILLed mid-training, then the flow run again",
         setup=kill_flow_process),
    Case("execution-timeout", "a runtime execution timeout on core 0 at step 15",
         _faults({"kind": "timeout", "core": 0, "step": 15, "phase": "train"})),
    Case("hardware-error", "an uncorrectable hardware error on core 1 at step 25",
         _faults({"kind": "hw", "core": 1, "step": 25, "phase": "train"})),
    Case("hung-collective-preflight", "core 1 hangs in collectives: preflight names it, the run goes on without it",
         {**_faults({"kind": "hang", "core": 1}), "preflight": {"exclude_bad_cores": True,
                                                               "collective_timeout_seconds": 15}},
         seen=lambda row: 1 not in row["train_cores"]),
    Case("hung-collective-training", "rank 1 stops answering at step 15: the all-reduce times out",
         _faults({"kind": "stall", "core": 1, "step": 15, "phase": "train"})),
    Case("s3-slowdown", "every 4th S3 request answers SlowDown (503), reads and writes", storage="s3-SlowDown/4",
         seen=_api_retries),
    Case("s3-5xx", "every 4th S3 request answers InternalError (500), reads and writes",
         storage="s3-InternalError/4", seen=_api_retries),
    Case("torn-checkpoint", "rank 0 killed halfway through writing the step-20 checkpoint in the background",
         _faults({"kind": "torn", "core": 0, "step": 20, "phase": "train"})),
    Case("kill-during-background-write", "rank 1 killed while rank 0 writes the step-20 checkpoint in the "
         "background", _faults({"kind": "torn", "core": 1, "step": 20, "phase": "train"})),
    Case("loss-spike-rollback", "rank 1's loss spikes a thousandfold at step 25: training goes back to step 20 and "
         "skips step 25's batch (train.on_divergence: rollback), as the fault-free run told to skip it does",
         {**_faults({"kind": "spike", "core": 1, "step": 25, "phase": "train"}),
          "train": {"skip_steps": [], "on_divergence": "rollback"}},
         baseline="skip-25", seen=lambda row: row["retries_by"].get("rollback") == 1),
    Case("corrupt-cache-entry", "a compiled artifact in the compile cache cut short", setup=corrupt_cache_entry,
         seen=lambda row: row["compiled"] == 1),
    Case("torn-inference-shard", "rank 0 killed halfway through writing its second embedding shard",
         _faults({"kind": "torn", "core": 0, "step": 2, "phase": "infer"}),
         seen=lambda row: row["retries_by"].get("task:infer", 0) == 1),
    Case("sagemaker-internal-error", "SageMaker loses training's instance after a checkpoint (InternalServerError)",
         storage="sagemaker", seen=lambda row: row["retries_by"].get("service", 0) == 1),
    Case("batch-host-failure", "AWS Batch loses a host of the two-node training job after a checkpoint",
         storage="batch", seen=lambda row: row["retries_by"].get("service", 0) == 1),
    Case("batch-stalled-main-node", "the main node of the two-node Batch training job stops answering at step 15: "
         "node 1 fails, and trnflow stops the job", {"preflight": {"collective_timeout_seconds": 15}},
         storage="batch", node_faults={0: "stall@0:train:15"},
         seen=lambda row: row["retries_by"].get("task:train", 0) == 1),
    Case("batch-bad-node-replaced", "the instance serving node 1 of the two-node Batch job hangs in the preflight: "
         "the job exits 79, trnflow terminates its instances, and Batch's retry preflights and trains on new ones",
         {"preflight": {"collective_timeout_seconds": 15}}, storage="batch", host_faults={1: "hang@0"},
         interruptions=0, seen=lambda row: bool(row["bad_hosts"]) and not {*row["bad_hosts"]} & {*row["train_hosts"]}),
    Case("batch-no-capacity", "AWS Batch has no trn1.32xlarge: each job waits RUNNABLE, is cancelled after "
         "compute.max_pending_minutes and runs on trn1n.32xlarge, the spec's next instance preference",
         {"compute": {"instance_preferences": ["trn1.32xlarge", "trn1n.32xlarge"], "max_pending_minutes": 0.05}},
         storage="batch", no_capacity={"trn1.32xlarge"}, interruptions=0,
         seen=lambda row: row["train_instance"] == "trn1n.32xlarge", ci=True),
    Case("sagemaker-spot-reclaim", "SageMaker reclaims the managed spot training job's instance after a checkpoint: "
         "training checkpoints the step the notice found it at, and the job restarts from there",
         {"compute": {"spot": True}}, storage="sagemaker", fault="spot",
         seen=lambda row: row["retries_by"].get("service", 0) == 1),
    Case("batch-spot-reclaim", "EC2 reclaims the spot instance of a one-node Batch training job after a "
         "checkpoint: training reads the notice from the metadata service, checkpoints that step and exits 75, and "
         "Batch's retry resumes there on a new instance",
         {"compute": {"spot": True, "nodes": 1, "cores_per_node": 2}},
         storage="batch", fault="spot", seen=lambda row: row["retries_by"].get("service", 0) == 1),
    Case("fsdp-rank-sigkill", "sharded training (fsdp): a rank SIGKILLed at step 15",
         _faults({"kind": "kill", "core": 1, "step": 15, "phase": "train"}), baseline="fsdp"),
    Case("fsdp-torn-checkpoint", "sharded training (fsdp): rank 1 killed halfway through writing its shard of the "
         "step-20 checkpoint", _faults({"kind": "torn", "core": 1, "step": 20, "phase": "train"}), baseline="fsdp",
         ci=True),
    Case("tp-rank-sigkill", "a decoder's layers split over two cores (tp 2): a rank SIGKILLed at step 15",
         _faults({"kind": "kill", "core": 1, "step": 15, "phase": "train"}), baseline="tp"),
    Case("tp-torn-checkpoint", "a decoder's layers split over two cores (tp 2): rank 1 killed halfway through "
         "writing its shard of the step-20 checkpoint", _faults({"kind": "torn", "core": 1, "step": 20,
                                                                 "phase": "train"}), baseline="tp"),
    Case("fsdp-hardware-error-fewer-cores", "sharded training (fsdp) on a two-core trn1.2xlarge: a hardware error "
         "on core 1 at step 25 leaves one healthy core, so the retry resumes the two ranks' shards resharded onto one",
         {**_faults({"kind": "hw", "core": 1, "step": 25, "phase": "train"}),
          "compute": {"instance_type": "trn1.2xlarge"},
          "train": {"parallelism": {"strategy": "fsdp", "min_cores_per_node": 1}}},
         baseline="fsdp", rtol=1e-6, outputs_rtol=1e-5, ci=True,
         seen=lambda row: row["train_cores"] == [0] and row["retries_by"].get("task:train", 0) == 1),
    Case("disk-full", "no space left on the device while writing the step-30 checkpoint", setup=disk_full),
    Case("kill-torn-hw", "three in one run: a rank SIGKILLed at step 13, the step-20 checkpoint torn, then a "
         "hardware error on core 0 at step 25",
         {**_faults({"kind": "kill", "core": 1, "step": 13, "phase": "train"},
                    {"kind": "torn", "core": 0, "step": 20, "phase": "train"},
                    {"kind": "hw", "core": 0, "step": 25, "phase": "train"}),
          "retries": {"max_retries": 3, "backoff_seconds": 0}}, interruptions=3, ci=True),
]
