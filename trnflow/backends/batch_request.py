"""AWS Batch requests for one stage job: the job definition and the `SubmitJob` call, as pure
functions. A job is a multi-node parallel job on the on-demand queue, or, for a spot spec (one node:
Batch runs no multi-node job on spot compute environments), a single-node job on the spot queue,
which sets no node variables (its one node is the main node).

The job definition depends only on what shapes the nodes (image, instance type, node count,
devices), and is named by a hash of its content: registering it twice is harmless, and a changed
one gets a new name. Each node runs the image's entrypoint, `python -m trnflow.backends.container`, with
the command `batch`; it reads `AWS_BATCH_JOB_NODE_INDEX`, `AWS_BATCH_JOB_NUM_NODES` and
`AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS` (absent on the main node itself) and starts torchrun.
"""

from __future__ import annotations

import hashlib
import json
from fnmatch import fnmatchcase
from typing import Any

from trnflow.backends.base import JobRequest
from trnflow.backends.cloud import (
    CloudTarget,
    container_environment,
    efa_environment,
    job_name,
    placement,
    runtime_seconds,
    tags,
)
from trnflow.errors import ExitCode, FatalError
from trnflow.specs import JobSpec, instance, memory_problem
from trnflow.teams import TEAM_TAG, Team

COMMAND = ["batch"]
"""The container's command: the image's entrypoint is `python -m trnflow.backends.container`."""
HOST_RESERVED_VCPUS = 32
"""Left to the ECS agent and the OS on each node (the Neuron samples ask 96 of 128 vCPUs); memory
is left to them as `trnflow.specs.HOST_RESERVED_MEMORY_GIB` says."""


def retry_strategy(spec: JobSpec) -> dict[str, Any]:
    """Host failures, transient device faults and instances that failed the preflight (exit code
    79, `BadHost`: trnflow terminates them first, so the retry runs on others) are retried by Batch;
    anything else (a user error, a bad spec, a failed gate) ends the job. The last rule matters:
    without it, Batch retries every failure that no rule matched. Batch takes at most five rules."""
    return {
        "attempts": min(10, 1 + spec.retries.max_retries),
        "evaluateOnExit": [
            {"action": "RETRY", "onStatusReason": "Host EC2*"},
            {"action": "RETRY", "onStatusReason": "Task failed to start"},
            {"action": "RETRY", "onExitCode": str(int(ExitCode.TRANSIENT))},
            {"action": "RETRY", "onExitCode": str(int(ExitCode.BAD_HOST))},
            {"action": "EXIT", "onReason": "*"},
        ],
    }


def exit_action(rules: list[dict[str, str]], exit_code: int | None, reason: str, status_reason: str) -> str:
    """What Batch does with a failed attempt: the action of the first `evaluateOnExit` rule whose
    every condition matches (globs), else RETRY, as the service does."""
    values = {"onExitCode": None if exit_code is None else str(exit_code), "onReason": reason or "",
              "onStatusReason": status_reason or ""}
    for rule in rules:
        conditions = {k: v for k, v in rule.items() if k in values}
        if all(values[k] is not None and fnmatchcase(values[k], v) for k, v in conditions.items()):
            return rule["action"].upper()
    return "RETRY"


def _devices(itype: str) -> list[dict[str, Any]]:
    t = instance(itype)
    neuron = [{"hostPath": f"/dev/neuron{i}", "containerPath": f"/dev/neuron{i}",
               "permissions": ["READ", "WRITE", "MKNOD"]} for i in range(t.chips)]
    efa = [{"hostPath": f"/dev/infiniband/uverbs{i}", "containerPath": f"/dev/infiniband/uverbs{i}",
            "permissions": ["READ", "WRITE", "MKNOD"]} for i in range(t.efa_devices)]
    return neuron + efa


def _memory_mib(spec: JobSpec) -> int:
    """The MEMORY each node's container reserves (MiB, as Batch counts it), never more than the
    instance can give: Batch would accept such a job and leave it RUNNABLE for ever. Spec
    validation refuses it first; this refuses a spec changed since (`model_copy` does not validate)."""
    problem = memory_problem(spec.compute.instance_type, spec.compute.container_memory_gib)
    if problem:
        raise FatalError(problem)
    return spec.compute.container_memory_gib * 1024


def _container(spec: JobSpec, target: CloudTarget, phase: str, role: str | None, efa: bool = True) -> dict[str, Any]:
    """A node's container; `efa`: a multi-node job's, on the instance type it names, with the
    instance's EFA devices and libfabric's settings (its launch template attaches the interfaces).
    A single-node job names no type (Batch ignores it there): its vCPUs, all but the host's share of
    the instance's, keep any smaller instance from taking it and any other job from sharing its one."""
    t = instance(spec.compute.instance_type)
    devices = _devices(t.name) if efa else [d for d in _devices(t.name) if d["hostPath"].startswith("/dev/neuron")]
    container: dict[str, Any] = {
        "image": target.image_for(spec),
        "command": COMMAND,
        **({"instanceType": t.name} if efa else {}),  # Batch places a single-node job by its vCPUs and memory
        "resourceRequirements": [
            {"type": "VCPU", "value": str(max(1, t.vcpus - HOST_RESERVED_VCPUS))},
            {"type": "MEMORY", "value": str(_memory_mib(spec))},
        ],
        "user": "root",
        "ulimits": [{"name": "memlock", "softLimit": -1, "hardLimit": -1}],
        "linuxParameters": {"devices": devices, "sharedMemorySize": 64 * 1024},
        "environment": [{"name": k, "value": v} for k, v in sorted((efa_environment(t.name) if efa else {}).items())],
    }
    container["jobRoleArn"] = role or target.role_for(phase)  # always one: the containers never use the instance's
    return container


def build_job_definition(spec: JobSpec, target: CloudTarget, phase: str = "train",
                         role: str | None = None) -> dict[str, Any]:
    """`RegisterJobDefinition` for the spec's nodes running a `phase` job as `role` (by default its
    stage kind's), named `trnflow-[<team>_]<name>-<content hash>`: a single-node definition for a spot spec,
    else a multi-node one. A job's role is in its definition (SubmitJob cannot override it), so a
    job with a role of its own has a definition of its own."""
    shape: dict[str, Any]
    if spec.compute.spot:
        shape = {"type": "container", "containerProperties": _container(spec, target, phase, role, efa=False)}
    elif not instance(spec.compute.instance_type).multi_node:
        raise FatalError(f"compute.instance_type: {spec.compute.instance_type} has no EFA; AWS Batch multi-node "
                         "jobs need trn1.32xlarge, trn1n.32xlarge or trn2.48xlarge (or set compute.spot: true, whose "
                         "single-node jobs run on any type of the spot queue)")
    else:
        shape = {"type": "multinode", "nodeProperties": {
            "numNodes": spec.compute.nodes,
            "mainNode": 0,
            "nodeRangeProperties": [{"targetNodes": "0:", "container": _container(spec, target, phase, role)}],
        }}
    body = {
        **shape,
        "retryStrategy": retry_strategy(spec),
        "timeout": {"attemptDurationSeconds": int(spec.compute.max_runtime_hours * 3600)},
        "platformCapabilities": ["EC2"],
        "propagateTags": True,
    }
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
    # a declared team's definitions (and so its jobs' log streams, `<definition>/default/<task>`) start
    # `trnflow-<team>_`, which no other team's and no spec name can (neither has a `_`): its spot
    # instances' role writes those streams alone
    team = "" if target.team.unrestricted else f"{target.team.name}_"
    return {"jobDefinitionName": f"trnflow-{team}{spec.name}-{digest}", **body,
            "tags": {"trnflow:job": spec.name, TEAM_TAG: target.team.name}}


def longest_seconds(request: JobRequest) -> int:
    """The longest a job of `request` can exist: each attempt Batch's retry strategy allows may wait
    for capacity (compute.max_pending_minutes, after which trnflow cancels it) and run to its limit."""
    spec = request.spec
    assert spec is not None, "cloud jobs always carry a spec"
    attempts = int(retry_strategy(spec)["attempts"])
    return attempts * (runtime_seconds(request) + int(spec.compute.max_pending_minutes * 60))


def build_submit_job(request: JobRequest, target: CloudTarget, job_definition: str) -> dict[str, Any]:
    """`SubmitJob` for one stage: the run's environment on every node, the node count, and fair share."""
    spec = request.spec
    if spec is None:
        raise FatalError("a Batch job needs a job spec")
    env = container_environment(request, target)
    if spec.compute.spot:  # a single-node job on the spot environment, whose instances attach no EFA
        env = {k: v for k, v in env.items() if k not in efa_environment(spec.compute.instance_type)}
    environment = [{"name": k, "value": v} for k, v in sorted(env.items())]
    shape: dict[str, Any] = {"containerOverrides": {"environment": environment}} if spec.compute.spot else {
        "nodeOverrides": {
            "numNodes": placement(request)[0],
            "nodePropertyOverrides": [{"targetNodes": "0:", "containerOverrides": {"environment": environment}}],
        }}
    submit: dict[str, Any] = {
        "jobName": job_name(request, target.team),
        "jobQueue": target.queue_for(spec),
        "jobDefinition": job_definition,
        **shape,
        "retryStrategy": retry_strategy(spec),
        "timeout": {"attemptDurationSeconds": runtime_seconds(request)},
        "propagateTags": True,
        "tags": tags(request, target.team),
    }
    if share := target.team.share_identifier or spec.compute.share_identifier:  # a declared team's share is its own
        submit["shareIdentifier"] = share
        submit["schedulingPriorityOverride"] = scheduling_priority(spec, target.team)
    return submit


def scheduling_priority(spec: JobSpec, team: Team) -> int:
    """A job's priority within its share of the fair-share queue: its run's class's
    (`compute.priority_class`), or, for a stack that declares no teams and a spec that names no class,
    the spec's own compute.scheduling_priority. FatalError for a class the team may not use (which
    `team_problems` refuses before launch)."""
    if team.unrestricted and spec.compute.priority_class is None:
        return spec.compute.scheduling_priority
    chosen = team.priority_class(spec.compute.priority_class)
    if chosen is None:
        raise FatalError(f"compute.priority_class: team {team.name} may not run {spec.compute.priority_class} runs")
    return chosen.priority


def queue_problems(spec: JobSpec, name: str, queue: dict[str, Any] | None) -> list[str]:
    """What Batch would refuse about submitting `spec`'s jobs to the job queue `name`, described as
    `DescribeJobQueues` gives it (None: there is no such queue). A queue with a fair-share scheduling
    policy refuses a job without a share identifier ("shareIdentifier must be specified"), and a
    queue without one refuses a share identifier."""
    setting, output = (("TRNFLOW_BATCH_SPOT_JOB_QUEUE", "BatchSpotJobQueue") if spec.compute.spot else
                       ("TRNFLOW_BATCH_JOB_QUEUE", "BatchJobQueue"))
    if not name:
        return [f"compute.spot: a spot job goes to the deployment's spot queue, and {setting} is not set; set it to "
                f"the {output} output of the CloudFormation stack in infra/"]
    if queue is None:
        return [f"{setting}: AWS Batch has no job queue {name!r} here; set it to the {output} output of the "
                "CloudFormation stack in infra/"]
    policy, share = queue.get("schedulingPolicyArn"), spec.compute.share_identifier
    if policy and not share:
        return [f"compute.share_identifier: the job queue {name} has a fair-share scheduling policy ({policy}), "
                "and Batch refuses every job without a share identifier there (shareIdentifier must be "
                "specified); set compute.share_identifier (and compute.fair_share: true, so that "
                "`trnflow validate` checks it)"]
    if share and not policy:
        return [f"compute.share_identifier: the job queue {name} has no fair-share scheduling policy, and Batch "
                "refuses a share identifier there; remove compute.share_identifier (and set compute.fair_share: "
                "false)"]
    return []
