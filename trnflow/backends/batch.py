"""The AWS Batch backend: each stage job is a multi-node parallel job on the deployment's queue (a
spot spec's, a single-node job on its spot queue).

`submit` registers the job definition unless one with its content-hash name is active, hands the
spec over in the staging bucket and submits; `describe` polls `DescribeJobs` (through `trnflow.aws`,
which retries throttling and 5xx) and reads the result or the nodes' failure reports the container
uploaded; `logs` reads the main node's CloudWatch stream; `cancel` terminates the job.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from trnflow import aws
from trnflow.backends.base import JobDetails, JobInfo, JobRequest, JobState, fitted, stage_result
from trnflow.backends.batch_request import build_job_definition, build_submit_job, longest_seconds, queue_problems
from trnflow.backends.cloud import (
    STOPPED_BY_TRNFLOW,
    CloudTarget,
    JobRoles,
    NodeWatch,
    every_identity,
    node_reports,
    stage_spec,
)
from trnflow.backends.cloudwatch import StreamReader
from trnflow.backends.failures import report_order
from trnflow.backends.provisioning import Provisioning, batch_provisioning
from trnflow.backends.service_status import (
    CANCEL_REASON,
    INTERRUPT_REASON,
    batch_billable_seconds,
    batch_failure,
    batch_state,
)
from trnflow.errors import ExitCode, FatalError
from trnflow.results import FailureReport
from trnflow.specs import JobSpec
from trnflow.storage import Store, open_store

LOG_GROUP = "/aws/batch/job"
log = logging.getLogger("trnflow.backends")
BAD_HOST_LOOK_SECONDS = 2.0
"""How often a running attempt's node reports are listed for a failed preflight (a LIST request)."""


class BatchBackend:
    name = "batch"
    picks_instance_type = False
    """Batch runs each job on the one instance type its definition names: `run_job` tries the next of
    compute.instance_preferences when a job found no capacity."""
    shares_allocation = True
    """The preflight and training run as phases of one job, on the same instances."""

    def __init__(self, target: CloudTarget):
        self.target = target
        session = aws.session()
        self._batch = aws.client("batch", boto_session=session)
        self._ec2 = aws.client("ec2", boto_session=session)
        self._replaced: set[tuple[str, int]] = set()  # (job, attempt) whose bad instances were terminated
        self._looked: dict[str, float] = {}  # job -> when a running attempt's reports were last listed
        self._hosts_of: dict[str, tuple[int, list[str]]] = {}  # job -> (attempt, its instances by node)
        self._hosts_failed: dict[str, float] = {}  # job -> when its instances could last not be looked up
        self._provisioned: dict[str, Provisioning | None] = {}  # ended jobs: their instances, as EC2 has them
        self._spot_prices: dict[str, float | None] = {}  # ended spot jobs: the spot price their instances paid
        self._ecs = aws.client("ecs", boto_session=session)
        self._clusters: dict[str, list[str]] = {}  # job queue -> the ECS clusters of its compute environments
        self._logs = aws.client("logs", boto_session=session)
        self._rules: dict[str, list[dict[str, str]]] = {}
        self._queues: dict[str, dict[str, Any] | None] = {}
        self._streams: dict[str, tuple[str, int]] = {}  # job -> (its attempt's stream, the cursor it began at)
        self.nodes = NodeWatch()  # stops a job whose other node failed while its main node went on
        self._waits: dict[str, tuple[float, str, str]] = {}  # job -> (seconds it may wait, instance type, queue)
        self._starved: dict[str, FailureReport] = {}  # jobs stopped for waiting longer than that
        self._reader = StreamReader(self._logs, LOG_GROUP)
        self.roles = JobRoles(target, session)

    def _job_definition(self, body: dict[str, Any]) -> str:
        """The name of an active definition with this content, registering it if there is none."""
        name = body["jobDefinitionName"]
        found = aws.call(self._batch.describe_job_definitions, jobDefinitionName=name, status="ACTIVE")
        if not found["jobDefinitions"]:
            aws.call(self._batch.register_job_definition, **body)
        return name

    def problems(self, spec: JobSpec) -> list[str]:
        """What the deployment's job queue would refuse about `spec` (`queue_problems`): the queue is
        described once, so a spec that would be refused fails before any job is submitted."""
        name = self.target.queue_for(spec)
        if name and name not in self._queues:
            found = aws.call(self._batch.describe_job_queues, jobQueues=[name])["jobQueues"]
            self._queues[name] = found[0] if found else None
        return queue_problems(spec, name, self._queues.get(name))

    def submit(self, request: JobRequest) -> str:
        if request.spec is None:
            raise FatalError(f"the {request.phase} phase needs a job spec to run on AWS Batch")
        problems = self.problems(request.spec)
        if problems:
            raise FatalError("; ".join(problems))
        request = fitted(request)
        role = self.roles.make(request, longest_seconds(request))
        try:
            definition = self._job_definition(build_job_definition(request.spec, self.target, request.last_phase,
                                                                   role))
            stage_spec(self.target, request)
            submitted = aws.call(self._batch.submit_job, **build_submit_job(request, self.target, definition))
        except BaseException:
            self.roles.unused(role)
            raise
        self.roles.submitted(submitted["jobId"], role)
        compute = request.spec.compute
        self._waits[submitted["jobId"]] = (compute.max_pending_minutes * 60, compute.instance_type,
                                           self.target.queue_for(request.spec))
        return submitted["jobId"]

    def _stop_if_starved(self, job_id: str, desc: dict[str, Any]) -> None:
        """Cancel a job still RUNNABLE after `compute.max_pending_minutes`: Batch would leave it waiting
        for capacity for ever. It fails as a CapacityError, which is retried (on the next of
        compute.instance_preferences, when the spec lists more)."""
        limit, itype, queue = self._waits.get(job_id, (0.0, "", ""))
        if not limit or job_id in self._starved or desc["status"] != "RUNNABLE":
            return
        attempts = desc.get("attempts") or []
        since = (attempts[-1].get("stoppedAt") if attempts else None) or desc.get("createdAt") or 0
        waited = time.time() - since / 1000
        if waited < limit:
            return
        why = desc.get("statusReason") or "no reason given"
        self._starved[job_id] = FailureReport(type="CapacityError", retryable=True, message=(
            f"AWS Batch found no capacity for {desc.get('jobName')} ({job_id}): still RUNNABLE in the job queue "
            f"{queue} after {waited / 60:.1f} min (compute.max_pending_minutes) waiting for "
            f"{itype} instances ({why})"))
        aws.call(self._batch.terminate_job, jobId=job_id,
                 reason=f"{STOPPED_BY_TRNFLOW}no {itype} capacity after {limit / 60:g} min in RUNNABLE"[:255])

    def _describe(self, job_id: str) -> dict[str, Any]:
        jobs = aws.call(self._batch.describe_jobs, jobs=[job_id])["jobs"]
        if not jobs:
            raise KeyError(f"AWS Batch has no job {job_id!r}")
        return jobs[0]

    def _exit_rules(self, desc: dict[str, Any]) -> list[dict[str, str]]:
        if "retryStrategy" in desc:
            return desc["retryStrategy"].get("evaluateOnExit", [])
        arn = desc["jobDefinition"]
        if arn not in self._rules:
            found = aws.call(self._batch.describe_job_definitions, jobDefinitions=[arn])["jobDefinitions"]
            self._rules[arn] = (found[0].get("retryStrategy") or {}).get("evaluateOnExit", []) if found else []
        return self._rules[arn]

    def _outputs(self, desc: dict[str, Any]) -> Any:
        """Where the job's nodes left their result and failure reports."""
        run_id = desc.get("tags", {}).get("trnflow:run-id", "")
        return open_store(f"{self.target.staging_url.rstrip('/')}/{run_id}/{desc['jobName']}/output/{desc['jobId']}")

    def outputs(self, job_id: str) -> Store:
        """Where the job's nodes leave their results, failures and identities as it runs."""
        return self._outputs(self._describe(job_id))

    def _failure_report(self, desc: dict[str, Any]) -> FailureReport | None:
        """The root failure among the nodes' reports of the last attempt (an earlier attempt's are not
        its): a node's own error before a lost peer, then the one written first."""
        attempts = desc.get("attempts") or []
        since = (attempts[-1].get("startedAt") or 0) / 1000 - 1 if attempts else 0.0  # S3 keeps whole seconds
        reports = [report for _, report in node_reports(self._outputs(desc), since)]
        if not reports:
            return None
        return min(reports, key=report_order)

    def _stop_if_a_node_failed(self, job_id: str, desc: dict[str, Any]) -> None:
        """Terminate a running job one of whose other nodes has failed (`NodeWatch`). Batch does not
        retry a terminated job; the nodes' root failure says whether trnflow resubmits it."""
        attempts = desc.get("attempts") or []  # a retried attempt starts after the last one stopped
        since = max(desc.get("startedAt") or 0, (attempts[-1].get("stoppedAt") or 0) if attempts else 0) / 1000
        why = self.nodes.should_stop(job_id, self._outputs(desc), since)
        if why is not None:
            aws.call(self._batch.terminate_job, jobId=job_id, reason=f"{STOPPED_BY_TRNFLOW}{why}"[:255])

    def _replace_bad_hosts(self, job_id: str, desc: dict[str, Any]) -> None:
        """Terminate the instances an attempt found at fault, once per attempt: those its preflight
        failed (`BadHost`, exit code 79), and the suspect hosts of a failure a retry can help with
        (exit code 75: the hosts of the ranks training's pace found hung or slow, see
        `container.with_suspects`); as soon as a node's report is there while the attempt runs, else
        once it ended. Batch retries those exit codes (and a host terminated under the attempt), but
        would place the retry on the instances the compute environment already holds, the bad one
        included; terminated, it is replaced by a new instance, and the retry's preflight checks that
        one. The report names the nodes at fault (and, where a node could read it, their instance);
        only instances the services say those nodes of the attempt ran on are terminated: a report
        naming any other instance (a job writes its report as it likes) is refused and logged."""
        attempts = desc.get("attempts") or []
        if attempts and (attempts[-1].get("container") or {}).get("exitCode") in (ExitCode.BAD_HOST,
                                                                                  ExitCode.TRANSIENT):
            number, since = len(attempts), (attempts[-1].get("startedAt") or 0) / 1000
        elif desc["status"] == "RUNNING" and time.time() - self._looked.get(job_id, 0.0) > BAD_HOST_LOOK_SECONDS:
            self._looked[job_id] = time.time()
            number = len(attempts) + 1
            since = max(desc.get("startedAt") or 0, (attempts[-1].get("stoppedAt") or 0) if attempts else 0) / 1000
        else:
            return
        if (job_id, number) in self._replaced:
            return
        reports = [r for _, r in node_reports(self._outputs(desc), since - 1)
                   if r.type == "BadHost" or (r.retryable and r.nodes)]
        # the nodes at fault, by index (a multi-node job's containers cannot read their instance), or by
        # instance where a node could (a single-node job's): either way only the attempt's own count
        nodes = sorted({n for r in reports for n in r.nodes})
        named = sorted({i for r in reports for i in r.instances if i.startswith("i-")})
        if nodes or named or number == len(attempts):  # an attempt that ended has said all it will
            self._replaced.add((job_id, number))
        if not nodes and not named:
            return
        try:  # the job's own nodes as Batch and ECS place them: a report, which the job wrote, proves nothing
            placed = {node: i for (n, node), i in self._placements(desc).items() if n == number}
        except Exception as exc:  # fails closed: nothing is terminated; the retry's own preflight still checks
            log.warning("Batch job %s: could not tell which instances attempt %d ran on (%s), so none of %s is "
                        "terminated", desc.get("jobName"), number, exc, ", ".join(named or map(str, nodes)))
            return
        own = set(placed.values())
        bad = sorted({placed[n] for n in nodes if n in placed} | {i for i in named if i in own})
        if refused := [i for i in named if i not in own]:
            log.warning("Batch job %s: its nodes' preflight report names %s, which attempt %d did not run on (its "
                        "instances: %s); refused, as a report naming another job's instances is",
                        desc.get("jobName"), ", ".join(refused), number, ", ".join(sorted(own)) or "none found")
        if not bad:
            return
        try:
            aws.call(self._ec2.terminate_instances, InstanceIds=bad)
        except Exception as exc:  # the retry's own preflight still keeps a bad instance from training
            log.warning("Batch job %s: could not terminate %s, which failed the preflight (%s); Batch's retry may run "
                        "on it again, and its preflight fail again", desc.get("jobName"), ", ".join(bad), exc)
            return
        what = "failed the preflight" if reports[0].type == "BadHost" else "named suspect hosts"
        log.warning("Batch job %s: attempt %d %s (%s); terminated %s, so that the job's next attempt runs on other "
                    "instances", desc.get("jobName"), number, what, reports[0].message, ", ".join(bad))

    def _placements(self, desc: dict[str, Any]) -> dict[tuple[int, int], str]:
        """The EC2 instance each node ran on in each attempt, the running one too (the attempt after
        the last that ended), as the services have it: each node's container instance (`DescribeJobs`
        of `<job id>#<node>` for a multi-node job), then its EC2 instance (ECS's
        `DescribeContainerInstances`, in the clusters of the job queue's compute environments). No
        node's own word is taken: a job can write what it likes, and a multi-node job's containers
        cannot reach the metadata service. {(attempt, node): instance id}."""
        nodes = (desc.get("nodeProperties") or {}).get("numNodes")
        children = aws.call(self._batch.describe_jobs, jobs=[f"{desc['jobId']}#{i}" for i in range(nodes)]
                            )["jobs"] if nodes else [desc]
        placed: dict[str, list[tuple[int, int]]] = {}  # container instance -> (attempt, node) it served
        for child in children:
            node = int((child.get("nodeDetails") or {}).get("nodeIndex", 0))
            attempts = child.get("attempts") or []
            running = [child.get("container") or {}] if child.get("status") in ("STARTING", "RUNNING") else []
            for number, container in enumerate([a.get("container") or {} for a in attempts] + running, 1):
                if container.get("containerInstanceArn"):
                    placed.setdefault(container["containerInstanceArn"], []).append((number, node))
        found: dict[tuple[int, int], str] = {}
        for cluster in self._queue_clusters(desc["jobQueue"]) if placed else []:
            answer = aws.call(self._ecs.describe_container_instances, cluster=cluster,
                              containerInstances=sorted(placed))
            for c in answer.get("containerInstances", []):
                if c.get("ec2InstanceId"):
                    found |= dict.fromkeys(placed.get(c["containerInstanceArn"], []), c["ec2InstanceId"])
        return found

    def _hosts(self, job_id: str, desc: dict[str, Any]) -> list[str]:
        """The instances of the job's latest attempt, by node, once every node has one (kept then); []
        before, or when the services cannot be asked (then again after BAD_HOST_LOOK_SECONDS)."""
        nodes = (desc.get("nodeProperties") or {}).get("numNodes") or 1
        attempt = len(desc.get("attempts") or []) + (0 if batch_state(desc).terminal else 1)
        cached = self._hosts_of.get(job_id)
        if cached is not None and cached[0] == attempt:
            return cached[1]
        if time.time() - self._hosts_failed.get(job_id, 0.0) < BAD_HOST_LOOK_SECONDS:
            return []
        try:
            placed = self._placements(desc)
        except Exception as exc:  # where it ran is then the nodes' host names
            self._hosts_failed[job_id] = time.time()
            log.warning("Batch job %s: could not read which instances it ran on (%s)", desc.get("jobName"), exc)
            return []
        hosts = [placed.get((attempt, n), "") for n in range(nodes)]
        if not all(hosts):
            return []
        self._hosts_of[job_id] = (attempt, hosts)
        return hosts

    def _queue_clusters(self, queue: str) -> list[str]:
        """The ECS clusters of the compute environments behind job queue `queue` (name or ARN)."""
        if queue not in self._clusters:
            found = aws.call(self._batch.describe_job_queues, jobQueues=[queue])["jobQueues"]
            environments = [e["computeEnvironment"] for q in found for e in q.get("computeEnvironmentOrder", [])]
            described = aws.call(self._batch.describe_compute_environments, computeEnvironments=environments
                                 )["computeEnvironments"] if environments else []
            self._clusters[queue] = [e["ecsClusterArn"] for e in described if e.get("ecsClusterArn")]
        return self._clusters[queue]

    def _instances(self, job_id: str, desc: dict[str, Any]) -> Provisioning | None:
        """An ended job's instances (`batch_provisioning`): where each node of each attempt ran, as the
        services say (`_placements`), when it started, as the node said, and when EC2 launched each
        instance; None when that cannot be told."""
        if job_id not in self._provisioned:
            try:
                placed = self._placements(desc)
                # ECS forgets a container instance an hour after it ended: a single-node job's node,
                # which could read its instance, then names it (for the bill alone)
                identities = [n.model_copy(update={"instance_id": placed.get((n.attempt, n.node)) or n.instance_id})
                              for n in every_identity(self._outputs(desc))]
                ids = sorted({n.instance_id for n in identities if n.instance_id})
                # a filter, not InstanceIds: EC2 forgets terminated instances after about an hour, and one it
                # forgot leaves the job on its attempts' running time instead of failing the call
                answer = aws.call(self._ec2.describe_instances, Filters=[{"Name": "instance-id", "Values": ids}]
                                  ) if ids else {"Reservations": []}
                found = [i for r in answer["Reservations"] for i in r["Instances"]]
                launched = {i["InstanceId"]: i["LaunchTime"].timestamp() for i in found}
                nodes = (desc.get("nodeProperties") or {}).get("numNodes") or 1
                self._provisioned[job_id] = batch_provisioning(desc, identities, launched, nodes)
                billed = self._provisioned[job_id]
                if desc.get("tags", {}).get("trnflow:spot") == "true" and billed is not None:
                    self._spot_prices[job_id] = self._spot_price(found, billed.instance_seconds)
            except Exception as exc:  # the bill then is the attempts' running time, as Batch reports it
                log.warning("Batch job %s: could not read which instances it started (%s); it is billed for its "
                            "attempts' running time", desc.get("jobName"), exc)
                self._provisioned[job_id] = None
        return self._provisioned[job_id]

    def _spot_price(self, instances: list[dict[str, Any]], seconds: dict[str, float]) -> float | None:
        """The job's spot price (USD an hour): each instance's, for its type and zone when it was
        launched, weighted by the seconds it is billed; None when EC2 does not say for every one (the
        job is then priced on demand)."""
        paid, held = 0.0, 0.0
        try:
            for i in instances:
                history = aws.call(self._ec2.describe_spot_price_history, InstanceTypes=[i["InstanceType"]],
                                   ProductDescriptions=["Linux/UNIX"], StartTime=i["LaunchTime"],
                                   EndTime=i["LaunchTime"], Filters=[{"Name": "availability-zone", "Values": [
                                       i["Placement"]["AvailabilityZone"]]}])["SpotPriceHistory"]
                if not history:
                    raise LookupError(f"no spot price of {i['InstanceType']} in {i['Placement']['AvailabilityZone']}")
                paid += float(history[0]["SpotPrice"]) * seconds.get(i["InstanceId"], 0.0)
                held += seconds.get(i["InstanceId"], 0.0)
        except Exception as exc:  # the cost table then prices the job on demand, and says no saving
            log.warning("could not read EC2's spot prices (%s); the spot job is priced on demand", exc)
            return None
        return round(paid / held, 6) if held else None

    def describe(self, job_id: str) -> JobInfo:
        desc = self._describe(job_id)
        state = batch_state(desc)
        if state.terminal and self.roles.ended(job_id) and desc.get("jobDefinition"):
            # the definition names the job's own role, which is gone: no other job can use it
            try:
                aws.call(self._batch.deregister_job_definition, jobDefinition=desc["jobDefinition"])
            except Exception as exc:  # the job's end stands; an active definition naming no role is only clutter
                log.warning("Batch job %s ended, and its definition %s could not be deregistered (%s)",
                            desc.get("jobName"), desc["jobDefinition"], exc)
        self._replace_bad_hosts(job_id, desc)
        details = JobDetails(seconds=batch_billable_seconds(desc), status=desc["status"],
                             attempts=len(desc.get("attempts") or []),
                             hosts=self._hosts(job_id, desc) if state in (JobState.RUNNING, JobState.SUCCEEDED)
                             else [])
        if state.terminal and (found := self._instances(job_id, desc)) is not None:
            details = replace(details, seconds=found.billable_seconds, instances_started=found.instances_started,
                              provisioning_seconds=found.seconds)
            if self._spot_prices.get(job_id) is not None:  # EC2 bills spot instances at the spot price
                details = replace(details, spot=True, running_seconds=found.billable_seconds,
                                  price_per_hour=self._spot_prices[job_id])
        if state is JobState.RUNNING:
            self._stop_if_a_node_failed(job_id, desc)
        if state is JobState.PENDING:
            self._stop_if_starved(job_id, desc)
        if state in (JobState.FAILED, JobState.CANCELLED) and job_id in self._starved:
            return JobInfo(job_id, JobState.FAILED, failure=self._starved[job_id], details=details)
        if state in (JobState.FAILED, JobState.CANCELLED) and self.nodes.stopped(job_id):
            return JobInfo(job_id, JobState.FAILED, details=details,
                           failure=self.nodes.failure(job_id, f"Batch job {desc.get('jobName')} ({job_id})"))
        if state is JobState.SUCCEEDED:
            result = stage_result(job_id, self._outputs(desc).read("result.json"), None)
            return JobInfo(job_id, state, result=result, details=details)
        if state is JobState.FAILED:
            failure = batch_failure(desc, self._exit_rules(desc), self._failure_report(desc))
            return JobInfo(job_id, state, failure=failure, details=details)
        return JobInfo(job_id, state, details=details)

    def logs(self, job_id: str, since: int = 0) -> tuple[str, int]:
        """The main node's log from `since` on. Each attempt writes a stream of its own: a retry's
        stream is read from its start, its lines counted after the last attempt's."""
        current = (self._describe(job_id).get("container") or {}).get("logStreamName")
        stream, base = self._streams.get(job_id, ("", 0))
        if current and current != stream:
            stream, base = current, since
            self._streams[job_id] = (stream, base)
        if not stream:
            return "", since
        text, cursor = self._reader.read(stream, since - base)
        return text, base + cursor

    def cancel(self, job_id: str) -> None:
        aws.call(self._batch.terminate_job, jobId=job_id, reason=CANCEL_REASON)

    def interrupt(self, job_id: str) -> None:
        """Ask the job to stop: Batch stops its containers as Docker does, SIGTERM first (training
        checkpoints at its next step boundary), SIGKILL after the agent's stop timeout."""
        aws.call(self._batch.terminate_job, jobId=job_id, reason=INTERRUPT_REASON)

    @staticmethod
    def stop_command(job_id: str) -> str:
        """The AWS CLI command that stops the job, for a person to run when trnflow could not."""
        return f'aws batch terminate-job --job-id {job_id} --reason "{CANCEL_REASON}"'
