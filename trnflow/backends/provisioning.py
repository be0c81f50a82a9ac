"""The instances a cloud job started, how long they took to be ready, and what they bill from
their start: pure functions of the service's describe answer (and, on Batch, of where the nodes
found themselves and when EC2 launched those instances).

- SageMaker: every `Starting` that led on to `Downloading` or `Training` launched the job's
  instances anew (its first start, a restart after an internal error, a managed spot restart).
  Provisioning is the time in `Starting` and `Downloading` (the instances, then the image and the
  data). SageMaker bills from `TrainingStartTime`, the download included, so its
  `BillableTimeInSeconds` already is the bill.
- Batch: each node's container says which EC2 instance it runs on in each attempt
  (`hosts/attempt<a>/node<r>.json`), and EC2's `LaunchTime` when that instance started. EC2 bills an
  instance from its launch, boot and image pull included, to the end of the last attempt it served
  (a retry runs on the instances still there); its provisioning is the time from its launch to its
  container's start. An instance the compute environment already held when the job was submitted
  (launched for an earlier job) was not started for it: it is billed from the submission.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from trnflow.results import NodeIdentity

SUBMIT_MARGIN_SECONDS = 1.0
"""EC2's and Batch's clocks, and LaunchTime's whole seconds: an instance launched this close before
the job's submission was launched for it."""
READY = ("Downloading", "Training")
"""Secondary statuses that only come once a SageMaker job's instances are up."""


@dataclass(frozen=True)
class Provisioning:
    instances_started: int
    seconds: float
    """The time the job waited for newly started instances to be ready, summed over its starts (each
    start waits for its slowest instance)."""
    billable_seconds: float | None = None
    """Seconds per node billed from the instances' launch (Batch); None where the service's own
    figure is the bill (SageMaker)."""
    instance_seconds: dict[str, float] = field(default_factory=dict)
    """Batch: the seconds billed for each instance (by id), which a spot job prices at its own price."""


def sagemaker_provisioning(desc: dict[str, Any]) -> Provisioning:
    """What a training job's instance starts were, from its `SecondaryStatusTransitions`. A `Starting`
    that never got instances (no capacity) started none."""
    config = desc.get("ResourceConfig") or {}
    count = config.get("SelectedInstanceCount") or config.get("InstanceCount") or 0
    transitions = desc.get("SecondaryStatusTransitions") or []
    starts, seconds = 0, 0.0
    for now, after in itertools.pairwise(transitions):
        if after.get("Status") not in READY:
            continue
        starts += now.get("Status") == "Starting"
        if now.get("Status") in ("Starting", "Downloading") and now.get("EndTime"):
            seconds += (now["EndTime"] - now["StartTime"]).total_seconds()
    return Provisioning(starts * count, round(seconds, 1))


def batch_provisioning(desc: dict[str, Any], identities: list[NodeIdentity], launched: dict[str, float],
                       nodes: int) -> Provisioning | None:
    """What a multi-node job's instances were, from every attempt's node identities and each
    instance's EC2 launch time (Unix seconds); None when a node could not name its instance (no
    metadata service), so that the attempts' running time stays the bill."""
    if not identities or any(n.instance_id not in launched for n in identities):
        return None
    attempts = desc.get("attempts") or []
    ends = {k: (a.get("stoppedAt") or 0) / 1000 for k, a in enumerate(attempts, 1)}
    submitted = (desc.get("createdAt") or 0) / 1000
    served: dict[str, list[NodeIdentity]] = {}
    for n in identities:
        served.setdefault(str(n.instance_id), []).append(n)
    billed, waits, each = 0.0, {}, {}
    for instance_id, used in served.items():
        # an instance the compute environment already held for an earlier job is billed to this one
        # from its submission on, and was not started for it
        fresh = launched[instance_id] >= submitted - SUBMIT_MARGIN_SECONDS
        began = launched[instance_id] if fresh else max(launched[instance_id], submitted)
        first = min(used, key=lambda n: n.attempt)
        end = ends.get(max(n.attempt for n in used)) or time.time()  # still running: so far
        each[instance_id] = max(0.0, end - began)
        billed += each[instance_id]
        if fresh:
            waits.setdefault(first.attempt, []).append(max(0.0, first.started_at - began))
    seconds = sum(max(w) for w in waits.values())
    started = sum(1 for i in served if launched[i] >= submitted - SUBMIT_MARGIN_SECONDS)
    return Provisioning(started, round(seconds, 1), billed / max(1, nodes), each)
