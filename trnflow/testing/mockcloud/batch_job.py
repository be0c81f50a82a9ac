"""One AWS Batch job, run the way Batch runs it: a multi-node parallel job gets, per attempt, one
container per node with the `AWS_BATCH_JOB_*` variables (the main node's address only on the child
nodes), the job ending with its main node; a single-node job one container, without node
variables. A failed attempt is retried or not as `retryStrategy.evaluateOnExit` says, and every
attempt is recorded in the job's `attempts`. A retry runs on the instances the last attempt had, but
for those that were terminated (or lost with it), which new ones replace.

A spot reclaim (a `spot` fault) is EC2's: the instance's metadata service gives the two-minute
notice, Batch tells the container nothing, and the instance is terminated once its container has
ended or the two minutes are up (`Host EC2 (instance i-...) terminated.`); ECS's spot draining keeps
the retry off it. A job terminated while it runs has its containers stopped as ECS stops them:
SIGTERM, then SIGKILL once `MockCloud.stop_grace_seconds` are up."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from moto.batch.models import JobStatus
from moto.ecs.models import ecs_backends

from trnflow.backends.batch_request import exit_action
from trnflow.backends.contract import JobEnv
from trnflow.neuron.launch import INSTANCE_CORES_ENV
from trnflow.neuron.runtime import RT_DIR_ENV
from trnflow.specs import instance
from trnflow.testing.mockcloud.instances import Instance
from trnflow.testing.mockcloud.nodes import Node, Notice, container_env, free_port, run_nodes
from trnflow.testing.mockcloud.sagemaker_job import committed_checkpoints

LOG_GROUP = "/aws/batch/job"
NO_CAPACITY = ("CAPACITY:INSUFFICIENT_INSTANCE_CAPACITY - Service cannot fulfill the capacity requested for instance "
               "type [{}]")
"""The status reason Batch gives a job left RUNNABLE for lack of instances of its type."""
HOST_TERMINATED = "Host EC2 (instance {}) terminated."
"""The status reason of an attempt whose instance was terminated under it."""


def _millis(moment: float) -> int:
    return int(moment * 1000)


def submit_refusal(backend: Any, body: dict[str, Any]) -> str | None:
    """What AWS Batch's SubmitJob refuses and moto accepts, as the service words it, or None: a job
    without a share identifier on a queue with a fair-share scheduling policy."""
    queue = backend.get_job_queue(body.get("jobQueue", ""))
    if queue is not None and queue.schedule_policy and not body.get("shareIdentifier"):
        return "shareIdentifier must be specified."
    return None


class BatchJob:
    def __init__(self, cloud: Any, job: Any, body: dict[str, Any]):
        self.cloud, self.job, self.body = cloud, job, body
        self.status = JobStatus
        props = job.job_definition.node_properties or {}
        self.multinode = bool(props)
        overrides = body.get("nodeOverrides") or {}
        if self.multinode:
            self.container = props["nodeRangeProperties"][0]["container"]
            self.nodes = overrides.get("numNodes") or props.get("numNodes", 1)
            layers = [o.get("containerOverrides", {}) for o in overrides.get("nodePropertyOverrides", [])]
        else:
            self.container, self.nodes = job.job_definition.container_properties or {}, 1
            layers = [body.get("containerOverrides") or {}]
        env = {e["name"]: e["value"] for e in self.container.get("environment", [])}
        for layer in layers:
            env |= {e["name"]: e["value"] for e in layer.get("environment", [])}
        self.env = env
        self.phase = env.get(JobEnv.var("phase"), "")
        strategy = body.get("retryStrategy") or job.job_definition.retry_strategy or {}
        self.strategy = strategy
        self.attempts = int(strategy.get("attempts", 1))
        self.rules = strategy.get("evaluateOnExit", [])
        self._stop: str | None = None
        self._held: list[Instance] = []  # the instances the job's attempts run on, kept between attempts
        self._arns: dict[str, str] = {}  # instance id -> its ECS container instance, once it joined
        self._placed: list[list[str]] = []  # each recorded attempt's nodes' container instances, by node
        self._current: list[str] = []  # the running attempt's
        # moto (without Docker) has already marked the job SUCCEEDED: take it back to the queue
        job.job_stopped, job.job_stopped_reason, job.exit_code = False, None, None
        job.attempts, job.latest_attempt = [], None
        job.status = JobStatus.RUNNABLE

    @property
    def itype(self) -> str:
        """The instance type the job runs on: the one a multi-node job names; for a single-node job
        (which names none: Batch ignores it there), the first type of its queue's compute
        environments with the vCPUs and memory it asks for, as Batch places it."""
        if self.multinode:
            return self.container.get("instanceType", "trn1.32xlarge")
        wants = {r["type"]: int(r["value"]) for r in self.container.get("resourceRequirements", [])}
        for environment in self.job.job_queue.environments:
            for name in (environment.compute_resources or {}).get("instanceTypes", []):
                t = instance(name)
                if t.vcpus >= wants.get("VCPU", 1) and t.host_memory_gib * 1024 >= wants.get("MEMORY", 0):
                    return name
        raise ValueError(f"no instance type of job queue {self.job.job_queue.name} has the vCPUs and memory the "
                         f"job asks for ({wants}); Batch would leave it RUNNABLE")

    def described(self) -> dict[str, Any]:
        """What DescribeJobs tells of the job that moto drops: the retry strategy it runs under (the
        submission's, else its definition's), its node count, and its share identifier and
        scheduling priority."""
        described: dict[str, Any] = {"retryStrategy": self.strategy} if self.strategy else {}
        if self.multinode:
            described["nodeProperties"] = {"numNodes": self.nodes, "mainNode": 0}
        if self.body.get("shareIdentifier"):
            described["shareIdentifier"] = self.body["shareIdentifier"]
            described["schedulingPriority"] = self.body.get("schedulingPriorityOverride", 0)
        return described

    def child(self, index: int) -> dict[str, Any]:
        """What DescribeJobs tells of node `index` of a multi-node job (`<job id>#<index>`): where each
        attempt placed it (`containerInstanceArn`, the ECS container instance on the EC2 instance)."""
        job = self.job
        attempts = [{**{k: v for k, v in attempt.items() if k != "container"},
                     "container": {**attempt["container"], "containerInstanceArn": placed[index]}
                     if index < len(placed) else {k: v for k, v in attempt["container"].items()
                                                   if k != "containerInstanceArn"}}
                    for attempt, placed in zip(job.attempts, self._placed, strict=False)]
        described = {"jobId": f"{job.job_id}#{index}", "jobName": job.job_name, "status": job.status,
                     "attempts": attempts, "nodeDetails": {"nodeIndex": index, "isMainNode": index == 0}}
        if self._current and index < len(self._current):
            described["container"] = {"containerInstanceArn": self._current[index]}
        return described

    def _joined(self, instances: list[Instance]) -> list[str]:
        """Each instance's ECS container instance in the cluster of the queue's compute environment,
        registered as the ECS agent registers an instance that joins it."""
        environment = self.job.job_queue.environments[0]
        region, account = environment.arn.split(":")[3:5]
        for host in instances:
            if host.instance_id not in self._arns:
                joined = ecs_backends[account][region].register_container_instance(environment.ecs_name,
                                                                                   host.instance_id)
                self._arns[host.instance_id] = joined.container_instance_arn
        return [self._arns[host.instance_id] for host in instances]

    def stop(self, reason: str) -> None:
        self._stop = reason

    def _capacity(self) -> bool:
        """Wait, RUNNABLE, while the cloud has no instance of the job's type (`no_capacity`), as Batch
        leaves such a job queued for ever; False when the job was stopped meanwhile."""
        itype = self.itype
        while itype in self.cloud.no_capacity and not self._stop:
            self.job.status = self.status.RUNNABLE
            self.job.job_stopped_reason = NO_CAPACITY.format(itype)
            time.sleep(0.2)
        if not self._stop:
            self.job.job_stopped_reason = None
        return not self._stop

    def run(self) -> None:
        job = self.job
        try:
            for attempt in range(1, self.attempts + 1):
                if not self._capacity():
                    code, status_reason = None, self._stop
                    break
                code, reason, status_reason = self._attempt(attempt)
                if code == 0 or self._stop:
                    break
                if attempt == self.attempts or exit_action(self.rules, code, reason, status_reason) == "EXIT":
                    break
                job.status = self.status.RUNNABLE  # Batch puts a retried job back in the queue
                time.sleep(self.cloud.requeue_seconds)
        except Exception as exc:  # the emulation itself failed: say so, as the service would
            code, status_reason = None, f"mock cloud could not run the job: {exc!r}"
        finally:
            self.cloud.instances.stop(self._held)  # the compute environment lets them go
            self._held = []
        job.exit_code = code
        job.job_stopped_reason = self._stop or (status_reason if code != 0 else "Essential container in task exited")
        job.job_stopped_at = datetime.now()
        job.job_stopped = True
        job.status = self.status.SUCCEEDED if code == 0 and not self._stop else self.status.FAILED

    def _record(self, began: float, code: int | None, reason: str, status_reason: str) -> None:
        placed, self._current = self._current, []
        container = {"exitCode": code, "reason": reason, "logStreamName": self.job.log_stream_name,
                     "networkInterfaces": []}
        if placed:  # the main node's, as the job's own attempts say
            container["containerInstanceArn"] = placed[0]
        self._placed.append(placed)
        self.job.attempts.append({"container": container, "startedAt": _millis(began),
                                  "stoppedAt": _millis(time.time()), "statusReason": status_reason})

    def _node_env(self, attempt: int, index: int, port: int, host: Instance) -> dict[str, str]:
        itype = self.itype
        root = self.cloud.work_dir / "batch" / self.job.job_id / f"attempt-{attempt}" / f"node-{index}"
        batch = {"AWS_BATCH_JOB_ID": self.job.job_id, "AWS_BATCH_JOB_ATTEMPT": str(attempt),
                 "AWS_BATCH_JQ_NAME": self.job.job_queue.name}
        if self.multinode:
            batch |= {"AWS_BATCH_JOB_ID": f"{self.job.job_id}#{index}", "AWS_BATCH_JOB_NODE_INDEX": str(index),
                      "AWS_BATCH_JOB_NUM_NODES": str(self.nodes), "AWS_BATCH_JOB_MAIN_NODE_INDEX": "0"}
        if index:
            batch["AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS"] = "127.0.0.1"  # every node is this machine
        emulator = {INSTANCE_CORES_ENV: str(instance(itype).cores), RT_DIR_ENV: str(root / "neuron-rt"),
                    "TRNFLOW_HOME": str(root / "trnflow-home"), JobEnv.var("output_dir"): str(root / "output"),
                    JobEnv.var("master_port"): str(port)}
        if not self.multinode:  # a multi-node job's (awsvpc) containers are kept from it (ECS_AWSVPC_BLOCK_IMDS)
            emulator["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = host.endpoint
        return container_env(self.cloud.endpoint_url, self.cloud.region, self.env, batch, emulator,
                             self.cloud.node_layer(index, host.instance_id))

    def _instances(self, itype: str) -> list[Instance]:
        """The attempt's instances: the ones the job's last attempt ran on that still run (Batch places a
        retry on the instances the compute environment holds), and new ones for the rest."""
        gone = self.cloud.instances.gone(self._held)
        self.cloud.instances.stop(gone)
        kept = [i for i in self._held if i not in gone]
        new = self.cloud.instances.start(itype, self.nodes - len(kept))
        if new:  # they boot, join the compute environment and pull the image before the containers start
            time.sleep(self.cloud.provision_seconds + self.cloud.image_pull_seconds)
        self._held = kept + new
        return self._held

    def _attempt(self, attempt: int) -> tuple[int | None, str, str]:
        job, began = self.job, time.time()
        job.job_started_at = datetime.now()
        fault = self.cloud.take_fault("batch", self.phase, "start")
        if fault is not None:
            self._record(began, fault.exit_code, "", fault.reason)
            return fault.exit_code, "", fault.reason
        job.status = self.status.STARTING
        job.log_stream_name = f"{job._stream_name}/attempt-{attempt}" if attempt > 1 else job._stream_name
        port, command = free_port(), self.container.get("command", ["batch"])
        root = self.cloud.work_dir / "batch" / job.job_id / f"attempt-{attempt}"
        instances = self._instances(self.itype)
        self._current = self._joined(instances)
        nodes = [Node(list(command), self._node_env(attempt, i, port, instances[i]),
                      root / f"node-{i}" / "container.log",
                      job.log_stream_name if i == 0 else f"{job.log_stream_name}/node-{i}")
                 for i in range(self.nodes)]
        code, reason, status_reason = self._run_attempt(job, began, nodes, instances)
        if self._fault is not None or self._stop:
            self.cloud.instances.stop(self._held)  # a lost host or a stopped job: its instances went with it
            self._held = []
        return code, reason, status_reason

    def _run_attempt(self, job: Any, began: float, nodes: list[Node], instances: list[Instance]
                     ) -> tuple[int | None, str, str]:
        job.status = self.status.RUNNING
        watch = self._checkpoint_watch()
        looked = [time.monotonic()]
        reclaim: list[float] = []  # when EC2 takes the instances of a spot reclaim back

        def interrupt() -> str | Notice | None:
            if self._stop:  # Batch stops the containers as ECS does: SIGTERM, then SIGKILL after a grace
                return Notice(self._stop, self.cloud.stop_grace_seconds)
            if reclaim and time.monotonic() >= reclaim[0]:
                self.cloud.instances.stop(instances)  # the two minutes are up
            elif not reclaim and watch is not None and watch():
                fault = self.cloud.take_fault("batch", self.phase, "checkpoint")
                if fault is not None and fault.spot:  # the notice; the container goes on until it acts on it
                    for host in instances:
                        host.notify_reclaim(self.cloud.spot_grace_seconds)
                    reclaim.append(time.monotonic() + self.cloud.spot_grace_seconds)
                    return None
                self._fault = fault
                return fault.reason if fault else None
            if time.monotonic() - looked[0] > 2.0:  # an instance terminated under the attempt ends it
                looked[0] = time.monotonic()
                gone = self.cloud.instances.gone(instances)
                return HOST_TERMINATED.format(gone[0].instance_id) if gone else None
            return None

        self._fault = None
        codes, reason, _ = run_nodes(nodes, LOG_GROUP, self.cloud.client("logs"), interrupt)
        if reclaim:  # EC2 takes the instances back, whether or not the containers ended first
            self.cloud.instances.stop(instances)
        if reason is not None:
            code = self._fault.exit_code if self._fault else None
            self._record(began, code, "", reason)
            return code, "", reason
        code = codes[0]
        status_reason = "Essential container in task exited"
        self._record(began, code, "", status_reason)
        return code, "", status_reason

    def _checkpoint_watch(self) -> Any:
        url = self.env.get("TRNFLOW_CHECKPOINT_S3_URI")
        if not url or not self.cloud.pending_fault("batch", self.phase, "checkpoint"):
            return None
        s3 = self.cloud.client("s3")
        before = committed_checkpoints(s3, url)
        return lambda: committed_checkpoints(s3, url) > before
