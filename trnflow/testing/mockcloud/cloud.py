"""`MockCloud`: moto with the jobs run for real.

moto accepts SageMaker training jobs and Batch jobs but runs nothing: a training job is
`Completed` at once and (without Docker) a Batch job `SUCCEEDED`. Attached to the moto of this
process (in-process `mock_aws`, a `ThreadedMotoServer`, or both, which share one state), a
MockCloud takes over each job as it is created: it marks it running, runs its containers on the
NeuronCore emulator under the service's contract, and writes the final state, attempts, failure
reason and billable time back into moto, where `describe` calls find them.

moto drops parts of the requests it does not model (a training job's `Environment` and
`RetryStrategy`, a Batch job's `nodeOverrides`, `retryStrategy` and `shareIdentifier`, a
multi-node job definition's `nodeProperties` when described), so MockCloud reads each request as
it was sent, and puts what Batch's `DescribeJobs` and `DescribeJobDefinitions` tell of them back
in their answers. It refuses what the service refuses and moto does not: a Batch job without a
share identifier on a fair-share queue, and a training job named as one that exists (moto would
replace it). The containers reach AWS at `endpoint_url`, a moto server in this process.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
from moto.batch.exceptions import ClientException
from moto.batch.responses import BatchResponse
from moto.core.config import default_user_config
from moto.core.responses import ActionResult
from moto.ec2.responses.spot_instances import SpotInstances
from moto.sagemaker.exceptions import ResourceInUseException
from moto.sagemaker.responses import SageMakerResponse

from trnflow import aws
from trnflow.specs.instances import price
from trnflow.testing.mockcloud.batch_job import BatchJob, submit_refusal
from trnflow.testing.mockcloud.instances import Instances
from trnflow.testing.mockcloud.sagemaker_job import SageMakerJob


@dataclass
class ServiceFault:
    """A failure the emulated service inflicts on a job attempt."""

    service: str
    """`sagemaker` or `batch`."""
    phase: str
    """The workload phase of the jobs it strikes (`train`, `evaluate`, ...), alone or among others
    (`sanity+train`)."""
    reason: str
    """SageMaker's `FailureReason` (`InternalServerError: ...`, `AlgorithmError: ...`) or Batch's
    `statusReason` (`Host EC2 (instance i-...) terminated.`)."""
    when: str = "start"
    """`start`: the attempt fails before its containers run; `checkpoint`: it fails once the attempt
    has committed a new checkpoint (an instance lost mid-training)."""
    exit_code: int | None = None
    """Batch: the attempt's exit code (None when the host went away)."""
    times: int = 1
    """How many attempts it strikes."""
    spot: bool = False
    """A spot reclaim, with `MockCloud.spot_grace_seconds` between the notice and the instances' end.
    SageMaker sends the containers SIGTERM, and its managed spot training then restarts the job (status
    `Interrupted`); on Batch the notice is only in the instance's metadata service, and the job's retry
    strategy decides."""


class MockCloud:
    def __init__(self, endpoint_url: str, work_dir: Path, faults: list[ServiceFault] | None = None,
                 region: str = "us-east-1", node_faults: dict[int, str] | None = None,
                 no_capacity: set[str] | None = None, host_faults: dict[int, str] | None = None,
                 provision_seconds: float = 0.5, image_pull_seconds: float = 0.5):
        self.endpoint_url = endpoint_url.rstrip("/")
        self.work_dir = Path(work_dir)
        self.region = region
        self._faults = list(faults or [])
        self.no_capacity = set(no_capacity or ())
        """Instance types (`trn1.32xlarge`) the services have no capacity for: SageMaker fails a job that
        asks only for them with its capacity error, or launches the first of its InstancePreferences
        that has capacity; a Batch job for one stays RUNNABLE, as Batch leaves it."""
        self.spot_discount = 0.7
        """The share of the on-demand price a spot job does not pay (SageMaker reports it as
        BillableTimeInSeconds below TrainingTimeInSeconds). The real figure moves by the hour."""
        self.spot_grace_seconds = 120.0
        """How long a reclaimed spot instance's containers have after the notice (EC2's two minutes)."""
        self.stop_grace_seconds = 30.0
        """How long a stopped Batch job's containers have between SIGTERM and SIGKILL (ECS's
        ECS_CONTAINER_STOP_TIMEOUT, 30 s unless its agent is configured otherwise)."""
        self.sagemaker_stop_grace_seconds = 120.0
        """How long a stopped SageMaker training job's containers have between SIGTERM and their end."""
        self.node_faults = dict(node_faults or {})
        """Device faults (`TRNFLOW_FAULTS` syntax) of one node of every job, by node index (Batch's
        node index; SageMaker's host, algo-1 being 0): whichever instance serves that node, in every
        job and attempt (a fault no replacement cures)."""
        self.host_faults = dict(host_faults or {})
        """Device faults of a bad host (`TRNFLOW_FAULTS` syntax), by node index: they belong to the first
        instance that serves that node (on Batch; that host of the first job, on SageMaker) wherever it
        serves next, and an instance that replaces it is healthy."""
        self.bad_hosts: dict[str, str] = {}
        """The instances (SageMaker: `<job>/<host>`) that took `host_faults`, and their faults."""
        self.provision_seconds = provision_seconds
        """How long a new instance takes to boot and join (Batch's STARTING; SageMaker's `Starting`, unbilled)."""
        self.image_pull_seconds = image_pull_seconds
        """How long a new instance then takes to pull the training image (Batch's STARTING; SageMaker's
        `Downloading`, billed). A real Neuron image of more than 10 GB takes minutes: set these to rehearse it."""
        self.requeue_seconds = 2.0
        """How long a Batch job whose attempt failed stays RUNNABLE before its retry is placed."""
        self._lock = threading.Lock()
        self._session = boto3.session.Session(aws_access_key_id="testing", aws_secret_access_key="testing",  # noqa: S106
                                              region_name=self.region)
        self.instances = Instances(self.client("ec2"))
        """The EC2 instances Batch job attempts run on (minted in moto's EC2), with their metadata services."""
        self._jobs: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._saved: list[tuple[type, str, Any]] = []

    def client(self, service: str) -> Any:
        """A client of the emulated AWS, as the containers reach it: from one session, since each new
        session reads botocore's endpoints and service models from disk again (a third of a CPU-s)."""
        return aws.client(service, endpoint_url=self.endpoint_url, boto_session=self._session)

    # faults ---------------------------------------------------------------------------------
    def node_layer(self, index: int, host: str) -> dict[str, str]:
        """What a node's environment gets for its faults: its node index's (`node_faults`), and those
        of the instance or host serving it (`host_faults`, bound to the first that serves the index)."""
        with self._lock:
            if index in self.host_faults and host not in self.bad_hosts:
                self.bad_hosts[host] = self.host_faults.pop(index)
            faults = [f for f in (self.node_faults.get(index), self.bad_hosts.get(host)) if f]
        return {"TRNFLOW_FAULTS": ",".join(faults)} if faults else {}

    def take_fault(self, service: str, phase: str, when: str) -> ServiceFault | None:
        with self._lock:
            for fault in self._faults:
                if (fault.service, fault.when) == (service, when) and fault.phase in phase.split("+") \
                        and fault.times > 0:
                    fault.times -= 1
                    return fault
        return None

    def pending_fault(self, service: str, phase: str, when: str) -> bool:
        with self._lock:
            return any((f.service, f.when) == (service, when) and f.phase in phase.split("+") and f.times > 0
                       for f in self._faults)

    # jobs -----------------------------------------------------------------------------------
    def _start(self, key: str, runner: Any) -> None:
        self._jobs[key] = runner
        thread = threading.Thread(target=runner.run, name=f"mockcloud-{key}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def wait_idle(self, timeout: float = 600) -> None:
        for thread in list(self._threads):
            thread.join(timeout)

    # moto hooks -----------------------------------------------------------------------------
    def _patch(self, cls: type, name: str, fn: Any) -> None:
        self._saved.append((cls, name, cls.__dict__.get(name)))
        setattr(cls, name, fn)

    def attach(self) -> MockCloud:
        default_user_config["batch"] = {**default_user_config.get("batch", {}), "use_docker": False}
        cloud = self
        create_training_job, submit_job = SageMakerResponse.create_training_job, BatchResponse.submitjob
        terminate_job, cancel_job = BatchResponse.terminatejob, BatchResponse.canceljob
        describe_jobs, describe_definitions = BatchResponse.describejobs, BatchResponse.describejobdefinitions

        def on_create_training_job(response: Any) -> Any:
            body = json.loads(response.body)
            if body["TrainingJobName"] in response.sagemaker_backend.training_jobs:  # moto would replace it
                raise ResourceInUseException(f"Training job {body['TrainingJobName']} already exists.")
            answer = create_training_job(response)
            job = response.sagemaker_backend.training_jobs[body["TrainingJobName"]]
            cloud._start(body["TrainingJobName"], SageMakerJob(cloud, job, body))
            return answer

        def on_stop_training_job(response: Any) -> Any:
            name = json.loads(response.body)["TrainingJobName"]
            response.sagemaker_backend.describe_training_job(name)  # ValidationException when unknown
            runner = cloud._jobs.get(name)
            if runner is not None:
                runner.stop("Stopped by the caller")
            return ActionResult({})

        def on_submit_job(response: Any) -> str:
            body = json.loads(response.body)
            refusal = submit_refusal(response.batch_backend, body)
            if refusal:
                raise ClientException(refusal)
            answer = submit_job(response)
            job_id = json.loads(answer)["jobId"]
            job = response.batch_backend._jobs[job_id]
            cloud._start(job_id, BatchJob(cloud, job, body))
            return answer

        def on_describe_jobs(response: Any) -> str:
            answer = json.loads(describe_jobs(response))
            for job in answer["jobs"]:
                runner = cloud._jobs.get(job["jobId"])
                if isinstance(runner, BatchJob):
                    job.update(runner.described())
            for asked in json.loads(response.body or "{}").get("jobs") or []:  # a multi-node job's nodes
                parent, hash_sign, index = str(asked).partition("#")
                runner = cloud._jobs.get(parent)
                if hash_sign and index.isdigit() and isinstance(runner, BatchJob) and int(index) < runner.nodes:
                    answer["jobs"].append(runner.child(int(index)))
            return json.dumps(answer)

        def on_describe_job_definitions(response: Any) -> str:
            answer = json.loads(describe_definitions(response))
            for described in answer["jobDefinitions"]:
                definition = response.batch_backend.get_job_definition_by_arn(described["jobDefinitionArn"])
                if definition is not None and definition.node_properties:
                    described.setdefault("nodeProperties", definition.node_properties)
            return json.dumps(answer)

        def on_spot_price_history(response: Any) -> Any:
            """EC2's spot prices: moto answers $0.00001 an hour; the mock's are `spot_discount` off the
            price table's on-demand price, as of now."""
            now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")
            zones = response._filters_from_querystring().get("availability-zone") or [f"{cloud.region}a"]
            history = []
            for itype in response._get_param("InstanceTypes", []):
                found = price("ec2", itype)
                if found is not None:
                    usd = f"{found.usd_per_hour * (1 - cloud.spot_discount):.6f}"
                    history += [{"InstanceType": itype, "ProductDescription": "Linux/UNIX", "SpotPrice": usd,
                                 "AvailabilityZone": zone, "Timestamp": now} for zone in zones]
            return ActionResult({"SpotPriceHistory": history})

        def stopper(original: Any) -> Any:
            def on_stop(response: Any) -> str:
                runner = cloud._jobs.get(response._get_param("jobId"))
                if runner is not None:
                    runner.stop(response._get_param("reason"))
                    return ""
                return original(response)
            return on_stop

        self._patch(SageMakerResponse, "create_training_job", on_create_training_job)
        self._patch(SageMakerResponse, "stop_training_job", on_stop_training_job)
        self._patch(BatchResponse, "submitjob", on_submit_job)
        self._patch(BatchResponse, "describejobs", on_describe_jobs)
        self._patch(BatchResponse, "describejobdefinitions", on_describe_job_definitions)
        self._patch(SpotInstances, "describe_spot_price_history", on_spot_price_history)
        self._patch(BatchResponse, "terminatejob", stopper(terminate_job))
        self._patch(BatchResponse, "canceljob", stopper(cancel_job))
        return self

    def detach(self) -> None:
        for runner in list(self._jobs.values()):
            runner.stop("MockCloud detached")
        self.wait_idle(60)
        for cls, name, original in reversed(self._saved):
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        self._saved.clear()

    def __enter__(self) -> MockCloud:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()
