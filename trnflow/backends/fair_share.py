"""The stack's Batch fair-share scheduling policy, as its teams call for it: a share per team that
names one (`Team.share_identifier`), weighted by its `weight`. Batch favours a share with a lower
weight factor, so a team's factor is the inverse of its weight (weight 2: factor 0.5)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from trnflow import aws
from trnflow.errors import FatalError
from trnflow.teams import Teams

LOWEST, HIGHEST = 0.0001, 999.9999
"""Batch's bounds on a weight factor."""


class Share(BaseModel):
    """One share of the policy's distribution."""

    model_config = ConfigDict(extra="forbid")

    identifier: str = Field(description="The share identifier jobs name (a team's `share_identifier`).")
    weight_factor: float = Field(description="Batch's weight factor (lower: a larger share of the queue).")
    team: str | None = Field(None, description="The team whose share it is; None for one no team names.")


def factor(weight: float) -> float:
    """A team's weight (higher: more) as Batch's weight factor (lower: more)."""
    return min(HIGHEST, max(LOWEST, round(1.0 / weight, 4)))


def wanted(teams: Teams, current: list[Share]) -> list[Share]:
    """The distribution the teams call for: each team's share at its weight, then the shares the
    policy has that no team names (the stack's `default`), as they are."""
    mine = [Share(identifier=t.share_identifier, weight_factor=factor(t.weight), team=t.name)
            for t in teams.teams if t.share_identifier]
    named = {s.identifier for s in mine}
    return mine + [s for s in current if s.identifier not in named]


def policy_of(queue: str) -> str:
    """The ARN of the fair-share scheduling policy of Batch job queue `queue`: FatalError when it has none."""
    found = aws.call(aws.client("batch").describe_job_queues, jobQueues=[queue])["jobQueues"]
    if not found:
        raise FatalError(f"the Batch job queue {queue} does not exist; set TRNFLOW_BATCH_JOB_QUEUE to the stack's")
    arn = found[0].get("schedulingPolicyArn")
    if not arn:
        raise FatalError(f"the Batch job queue {queue} has no fair-share scheduling policy: its jobs go first in, "
                         "first out, and no share applies")
    return arn


def current(arn: str) -> tuple[list[Share], dict[str, Any]]:
    """The policy's distribution now, and the rest of its fair-share settings."""
    (policy,) = aws.call(aws.client("batch").describe_scheduling_policies, arns=[arn])["schedulingPolicies"]
    settings = dict(policy.get("fairsharePolicy") or {})
    shares = [Share(identifier=s["shareIdentifier"], weight_factor=s.get("weightFactor", 1.0))
              for s in settings.pop("shareDistribution", [])]
    return shares, settings


def apply(arn: str, shares: list[Share], settings: dict[str, Any]) -> None:
    """Give the policy the distribution `shares`, keeping its other settings (decay, reservation)."""
    distribution = [{"shareIdentifier": s.identifier, "weightFactor": s.weight_factor} for s in shares]
    aws.call(aws.client("batch").update_scheduling_policy, arn=arn,
             fairsharePolicy={**settings, "shareDistribution": distribution})
