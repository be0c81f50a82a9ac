"""A run's limits against its forecast: the deadline and budgets a run would miss and its team's
daily spend limit (checked before its first job), training's allowance of the run's budget, and
what each attempt of it may spend. The job holds its allowance as it trains
(`trnflow.workload.train`, priced by `trnflow.specs.instances.instance_cost`, the formula the cost
table uses)."""

from __future__ import annotations

from trnflow.errors import OverBudget
from trnflow.events import duration
from trnflow.reporting.forecast import Plan
from trnflow.specs import JobSpec
from trnflow.teams import Team


def has_limits(spec: JobSpec) -> bool:
    """Whether the spec sets a deadline or a budget, which its forecast is checked against."""
    return any(limit is not None for limit in (spec.train.max_minutes, spec.compute.max_cost_usd,
                                               spec.train.max_cost_usd))


def over_limits(spec: JobSpec, forecast: Plan | None) -> list[str]:
    """The spec's deadline (`train.max_minutes`) and budgets (`compute.max_cost_usd`,
    `train.max_cost_usd`) that a run forecast as `forecast` would miss, a line each naming the
    field, the figure and where it comes from; a limit that cannot be checked (no forecast, no
    price) is one too. Empty: within them."""
    if not has_limits(spec):
        return []
    if forecast is None:
        return ["the run has a deadline or a budget, and no forecast could be made to check it against (see the "
                "forecast line)"]
    train = forecast.stage("train")
    if train is None:
        return ["the run has a deadline or a budget, and its forecast has no training stage to check it against"]
    problems = []
    if spec.train.max_minutes is not None and train.seconds > spec.train.max_minutes * 60:
        problems.append(f"train.max_minutes: training is forecast to take {duration(train.seconds)} "
                        f"({train.source}: {train.basis}), past its deadline of {spec.train.max_minutes:g} min")
    unpriced = (f"no price is known for {spec.compute.instance_type} on {spec.compute.backend}, so the budget "
                "cannot be held; set compute.price_per_hour")
    budget = spec.compute.max_cost_usd
    if budget is not None and forecast.cost_usd is None:
        problems.append(f"compute.max_cost_usd: {unpriced}")
    elif budget is not None and (expected := forecast.expected_cost_usd) is not None and expected > budget:
        sources = ", ".join(sorted({s.source for s in forecast.stages}))
        priced = "at spot's measured share" if forecast.spot_cost_usd is not None else "on demand"
        problems.append(f"compute.max_cost_usd: the run is forecast to cost ${expected:.4f} {priced} (from "
                        f"{sources}; `trnflow plan` has each stage's), over its budget of ${budget:.4f}")
    cap = spec.train.max_cost_usd
    if cap is not None and train.cost_usd is None:
        problems.append(f"train.max_cost_usd: {unpriced}")
    elif cap is not None and train.cost_usd is not None and (spent := train.cost_usd * forecast.spot_share) > cap:
        problems.append(f"train.max_cost_usd: training is forecast to cost ${spent:.4f} "
                        f"({train.source}: {train.basis}), over its budget of ${cap:.4f}")
    return problems


def over_daily_spend(team: Team, forecast: Plan | None) -> str | None:
    """Why the team's daily spend limit refuses a run forecast as `forecast`, before its first job:
    no forecast could be made to hold it to the limit (it fails closed, as the run's budget does),
    or the forecast alone is over the limit, so the queue would never admit it. None: no limit, or
    within it."""
    limit = team.daily_spend_usd
    if limit is None:
        return None
    if forecast is None:
        return (f"team {team.name} has a daily spend limit (${limit:.2f}), and no forecast could be made to hold the "
                "run to it (see the forecast line)")
    if forecast.cost_usd is not None and forecast.cost_usd > limit:
        return (f"it is forecast to cost ${forecast.cost_usd:.2f}, more than team {team.name}'s daily spend limit "
                f"(${limit:.2f}); make it smaller, or ask the operators for a higher daily_spend_usd (the teams file)")
    return None


def training_budget(spec: JobSpec, forecast: Plan | None, spent_usd: float) -> tuple[float | None, str]:
    """What training may cost (`train.max_cost_usd` for its job) and how that was reckoned: the run's
    budget less what it has spent and the forecast cost of the stages after training, or the spec's
    own cap on training where that is less; (None, "") when neither limit is set. The job counts
    its cost at on-demand prices (it cannot see a spot price), so for a spot run priced at its
    measured share of on-demand the figure is given in on-demand dollars at that share."""
    budget, cap = spec.compute.max_cost_usd, spec.train.max_cost_usd
    if budget is None and cap is None:
        return None, ""
    share = forecast.spot_share if forecast is not None else 1.0
    basis = f"train.max_cost_usd ${cap:.4f}" if cap is not None else ""
    allowance = cap
    if budget is not None:
        later = forecast.after("train") if forecast is not None else []
        after = round(sum(s.cost_usd or 0.0 for s in later) * share, 4)
        left = round(budget - spent_usd - after, 4)
        reckoned = (f"compute.max_cost_usd ${budget:.4f} less ${spent_usd:.4f} spent before training and "
                    f"${after:.4f} forecast for the stages after it")
        if cap is None or left <= cap:
            allowance, basis = left, reckoned
        else:
            basis = f"{basis} (less than {reckoned})"
    assert allowance is not None
    if share < 1.0 and allowance > 0:
        return round(allowance / share, 4), (f"{basis}; ${allowance / share:.4f} at on-demand prices, spot paying "
                                             f"{share:.0%} of them")
    return allowance, basis


def attempt_allowance(budget_usd: float | None, spent_usd: float | None) -> float | None:
    """What an attempt of training may cost: the stage's allowance (`training_budget`) less what its
    earlier attempts cost; each attempt's own clock starts at zero, the budget does not. OverBudget
    when nothing is left; None: no limit."""
    if budget_usd is None or not spent_usd:
        return budget_usd
    left = round(budget_usd - spent_usd, 4)
    if left <= 0:
        raise OverBudget(f"training's earlier attempts cost ${spent_usd:.4f} of its budget of ${budget_usd:.4f}: "
                         "nothing is left; rerun with the same run id and a higher budget")
    return left
