"""What a run shows a person in the Prefect UI: locations they can open (S3's console) or copy (a
local path), and a stage table whose seconds are rounded."""


from trnflow.reporting.report import links_markdown, location_markdown
from trnflow.urls import shown


def test_a_local_location_is_a_plain_path_and_an_s3_one_a_console_link():
    assert shown("file:///runs/a%20b/step-000010") == ("/runs/a b/step-000010", None)
    assert shown("s3://bucket/runs/x/step-000010") == (
        "s3://bucket/runs/x/step-000010", "https://s3.console.aws.amazon.com/s3/buckets/bucket?prefix=runs/x/step-000010/")
    assert shown("s3://bucket/runs/x/parity.png")[1] == (
        "https://s3.console.aws.amazon.com/s3/object/bucket?prefix=runs/x/parity.png")
    assert location_markdown("file:///runs/x/parity.png") == "`/runs/x/parity.png`"
    text = links_markdown([("parity chart", "file:///runs/x/parity.png"), ("embeddings", "s3://b/out/_manifest.json")])
    assert "- parity chart: `/runs/x/parity.png`" in text and "file://" not in text
    assert "- embeddings: [s3://b/out/_manifest.json](https://s3.console.aws.amazon.com/s3/object/b?prefix=" in text


def test_the_stage_table_artifact_rounds_seconds():
    from trnflow.flows._stages import _cell

    assert _cell(3.8351991310000813) == 3.8 and _cell("Completed") == "Completed" and _cell(None) is None


def _trained(curve: list[tuple[int, float]], start_step: int = 0, loss: float | None = 0.1427):
    from trnflow.results import TrainResult

    return TrainResult(checkpoint=None, start_step=start_step, steps=200, loss=loss,
                       curve=[{"step": s, "global_step": s, "loss": v, "samples_per_s": 900.0, "graphs": 1}
                              for s, v in curve])


def test_the_train_stages_loss_is_the_last_logged_mean_with_its_steps_named():
    """Issue 42: the stage table's loss is the number of the last `train` log line (the mean since the
    point before), named so, and not the last step's own loss (the result's `loss`), which differs."""
    from trnflow.events import readable
    from trnflow.reporting.report import loss_figure

    curve = [(50, 0.3817), (100, 0.261), (150, 0.2578), (200, 0.2377)]
    assert loss_figure(_trained(curve)) == "loss 0.2377 (mean of steps 151-200)"
    line = readable({"event": "train", "rank": 0, "steps": 200, "step": 200, "loss": 0.2377, "samples_per_s": 900.0})
    assert line.startswith("train: step 200/200, mean loss 0.2377, ")  # the same number, as the log says it
    assert loss_figure(_trained(curve[:1])) == "loss 0.3817 (mean of steps 1-50)"
    # resumed at step 180: the last point averages only the steps this attempt ran
    assert loss_figure(_trained(curve, start_step=180)) == "loss 0.2377 (mean of steps 181-200)"
    assert loss_figure(_trained([*curve[:3], (151, 0.25)], start_step=150)) == "loss 0.2500 (step 151)"
    # resumed at its last step, nothing left to train: the last point is the earlier attempt's
    assert loss_figure(_trained(curve, start_step=200)) == "loss 0.2377 (mean of steps 151-200)"
    # no curve at all: the last step's loss, named so
    assert loss_figure(_trained([])) == "loss 0.1427 (the last step's)"
    assert loss_figure(_trained([], loss=None)) == "loss unknown"


def _drawn(fig) -> dict:
    """What a parity figure shows: its lines' and markers' labels with their points, and its notes."""
    ax = fig.axes[0]
    lines = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata(), strict=True)) for line in ax.lines}
    marks = {c.get_label(): [tuple(xy) for xy in c.get_offsets()] for c in ax.collections if c.get_label()[0] != "_"}
    return {"lines": lines, "marks": marks, "notes": [t.get_text() for t in ax.texts]}


def _points(*points: dict) -> list:
    from trnflow.records import MetricPoint

    return [MetricPoint.model_validate(p) for p in points]


def test_a_failed_gate_with_no_common_step_draws_both_series_and_says_nothing_was_compared():
    from trnflow.lifecycle.gate import Band, compare
    from trnflow.reporting.chart import parity_figure, parity_png

    candidate = _points({"step": 80, "accuracy": 0.71})
    reference = _points({"step": 30, "accuracy": 0.6}, {"step": 60, "accuracy": 0.7})
    verdict = compare(candidate, reference, Band(metric="accuracy", max_abs_diff=0.001))
    shown = _drawn(parity_figure(verdict, candidate, reference, "quickstart"))
    assert shown["lines"] == {"candidate": [(80, 0.71)], "reference": [(30, 0.6), (60, 0.7)]}
    assert shown["marks"] == {} and shown["notes"] == ["no evaluation step in common:\nnothing was compared"]
    assert parity_png(verdict, candidate, reference, "quickstart").startswith(b"\x89PNG")


def test_the_parity_chart_marks_the_compared_steps_and_those_outside_the_band():
    from trnflow.lifecycle.gate import Band, compare
    from trnflow.reporting.chart import parity_figure

    candidate = _points(*({"step": s, "accuracy": a} for s, a in ((100, 0.70), (200, 0.75), (300, 0.70))))
    reference = _points(*({"step": s, "accuracy": a}
                          for s, a in ((100, 0.70), (200, 0.7505), (250, 0.76), (300, 0.78))))
    verdict = compare(candidate, reference, Band(metric="accuracy", max_abs_diff=0.001))
    shown = _drawn(parity_figure(verdict, candidate, reference, "quickstart"))
    assert shown["lines"]["reference"] == [(100, 0.7), (200, 0.7505), (250, 0.76), (300, 0.78)]  # its own steps
    assert shown["marks"]["compared (3 steps)"] == [(100, 0.7), (200, 0.75), (300, 0.7)]
    assert shown["marks"]["outside the band"] == [(300, 0.7)] and shown["notes"] == []
