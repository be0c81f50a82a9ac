"""A run's goodput: the training its final weights hold, over the time the run took to get them
(its compile and train stages, every retry and wait included), with the rest itemized. The
holdout's evaluation of the final weights, after the last step, is the gate's measurement of them,
not part of getting them: it is reported beside, outside that time.

The training side is measured where it happens: each checkpoint carries where the training time
up to it went (`TrainTime`: the steps its weights hold, checkpoint stalls, rollbacks, waits for
slow ranks), along the attempts that led to it, so the final weights' account survives restarts.
The rest comes from the stage table (the stages' wall time) and the cost table (provisioning)."""

from __future__ import annotations

from trnflow.results import CostRow, Goodput, GoodputLosses, StageRow, TrainResult


def goodput(rows: list[StageRow], train: TrainResult | None, costs: list[CostRow]) -> Goodput | None:
    """The run's goodput once its training ended; None before, or when it trained nothing."""
    seconds = {r.stage: r.seconds or 0.0 for r in rows if r.state == "Completed"}
    if train is None or train.skipped or "train" not in seconds:
        return None
    provisioning = {c.stage: c.provisioning_seconds or 0.0 for c in costs}
    attempts = next((c.jobs for c in costs if c.stage == "train"), 1)
    compiling = max(0.0, seconds.get("compile", 0.0) - provisioning.get("compile", 0.0))
    waited = provisioning.get("compile", 0.0) + provisioning.get("train", 0.0)
    t, before = train.time, train.time_before
    held_before = (before.steps_seconds + before.stall_seconds + before.rollback_seconds + before.slow_seconds
                   + before.eval_seconds)
    # the attempts before the one whose weights these are (its launch, provisioning included, is `last`): their
    # provisioning is counted as such (the last one's too, so the restarts come out that much short)
    last = train.task_seconds or train.attempt_seconds
    earlier = seconds["train"] - last - provisioning.get("train", 0.0) if attempts > 1 else 0.0
    losses = GoodputLosses(compilation=compiling, provisioning=waited, checkpoint_stalls=t.stall_seconds,
                           restarts=max(0.0, earlier - held_before), rollbacks=t.rollback_seconds,
                           slow_ranks=t.slow_seconds, evaluations=t.eval_seconds)
    # the final weights' evaluation follows them: the gate's measurement, apart
    wall = compiling + waited + seconds["train"] - provisioning.get("train", 0.0) - train.final_eval_seconds
    if wall <= 0:
        return None
    wall, training = round(wall, 3), round(min(t.steps_seconds, wall), 3)
    other = max(0.0, wall - training - sum(value for _, value in losses))
    return Goodput(fraction=round(training / wall, 4), wall_seconds=wall, training_seconds=training,
                   losses=GoodputLosses(**{k: round(v, 3) for k, v in losses.model_copy(update={"other": other})}),
                   final_eval_seconds=round(train.final_eval_seconds, 3))
