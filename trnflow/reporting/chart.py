"""The parity chart: the candidate's metric against global step, beside the reference with its
allowed band, as a PNG."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from trnflow.records import CurvePoint, MetricPoint, Verdict

if TYPE_CHECKING:  # matplotlib is imported only when a chart is drawn
    from matplotlib.figure import Figure


def parity_png(verdict: Verdict, candidate: list[MetricPoint], reference: list[MetricPoint] | None, title: str
               ) -> bytes:
    """`parity_figure` as a PNG."""
    buffer = io.BytesIO()
    parity_figure(verdict, candidate, reference, title).savefig(buffer, format="png")
    return buffer.getvalue()


def parity_figure(verdict: Verdict, candidate: list[MetricPoint], reference: list[MetricPoint] | None, title: str
                  ) -> Figure:
    """The candidate's series and the reference's whole series, each at its own global steps; the
    points the gate compared (the reference's value drawn at the candidate's step, with the allowed
    band around it), the failed ones in red; and, when the two share no step, a note saying that
    nothing was compared. `title` states the decision (`judge.outcome`)."""
    import matplotlib  # ~0.5 s to import: only a chart pays for it

    matplotlib.use("Agg")  # no display: render to a buffer
    from matplotlib.figure import Figure  # after choosing the Agg backend

    metric = verdict.metric
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    steps = [p.global_step for p in candidate]
    ax.plot(steps, [p.value(metric) for p in candidate], marker="o", label="candidate", color="tab:blue", zorder=3)
    if reference:
        ax.plot([p.global_step for p in reference], [p.value(metric) for p in reference],
                marker="s", markersize=4, linestyle="--", color="tab:gray", alpha=0.7, label="reference")
    compared = sorted(verdict.points, key=lambda r: r.global_step)
    if compared:
        xs, ys = [r.global_step for r in compared], [r.reference for r in compared]
        ax.fill_between(xs, [y - verdict.allowed(y) for y in ys], [y + verdict.allowed(y) for y in ys],
                        color="tab:gray", alpha=0.25, label=f"allowed band ({verdict.text})")
        ax.scatter(xs, [r.candidate for r in compared], facecolors="none", edgecolors="black", s=110, zorder=4,
                   label=f"compared ({len(compared)} step{'s' if len(compared) > 1 else ''})")
    elif reference:
        ax.text(0.5, 0.5, "no evaluation step in common:\nnothing was compared", transform=ax.transAxes,
                ha="center", va="center", color="tab:red", fontsize=11)
    failed = [r for r in compared if not r.passed]
    if failed:
        ax.scatter([r.global_step for r in failed], [r.candidate for r in failed], color="tab:red", s=80, zorder=5,
                   label="outside the band")
    ax.set(title=title, xlabel="global step", ylabel=metric)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    return fig


def verdict_markdown(verdict: Verdict, title: str) -> str:
    """The verdict as a markdown table, one row per matched evaluation point, then the paired check."""
    metric = verdict.metric
    lines = [f"## {title}", "", f"**{'passed' if verdict.passed else 'FAILED'}** "
             f"({verdict.mode}, allowed {verdict.text}; {verdict.better} is better)", ""]
    if verdict.reason:
        lines += [verdict.reason, ""]
    if verdict.points:
        lines += [f"| step | global step | candidate {metric} | reference {metric} | diff | result |",
                  "|---:|---:|---:|---:|---:|---|"]
        for r in verdict.points:
            lines.append(f"| {r.step} | {r.global_step} | {r.candidate:.4f} | {r.reference:.4f} | "
                         f"{r.diff:+.4f} | {'pass' if r.passed else '**FAIL**'} |")
    if verdict.paired:
        lines += ["", paired_sentence(verdict)]
    return "\n".join(lines) + "\n"


def paired_sentence(verdict: Verdict) -> str:
    """McNemar's paired test in plain words: what it compared, what it found, and whether the
    holdout was large enough for it to find a difference the size of the band."""
    paired = verdict.paired
    assert paired is not None, "a verdict with a paired check"
    if not paired.available:
        return f"No paired test (McNemar's): {paired.reason}."
    band = verdict.allowed(verdict.points[-1].reference if verdict.points else 0.0)
    rows, size = paired.rows, f"{band:.2%}"
    found = (f"the two models differ (p = {paired.p_value:.2g}, below {paired.alpha})" if paired.significant
             else f"no evidence that the two models differ (p = {paired.p_value:.2g})")
    at = f"at step {paired.step}" if isinstance(paired.step, int) else "at each model's last step"
    text = (f"Paired test (McNemar's) on the same {rows:,} holdout rows {at}: the candidate alone "
            f"was right on {paired.candidate_only:,} rows, the reference alone on {paired.reference_only:,}; "
            f"{found}.")
    if paired.underpowered:
        return (f"{text} The holdout is too small for this test to see a {size} difference: that takes about "
                f"{paired.rows_needed:,} rows, so only the band above decided the gate.")
    return f"{text} {rows:,} rows are enough to see a {size} difference."


def training_png(curve: list[CurvePoint], evaluations: list[MetricPoint], metric: str, title: str) -> bytes:
    """The training loss against global step, with the holdout metric on a second axis."""
    import matplotlib  # ~0.5 s to import: only a chart pays for it

    matplotlib.use("Agg")
    from matplotlib.figure import Figure  # after choosing the Agg backend

    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    ax.plot([p.global_step for p in curve], [p.loss for p in curve], color="tab:orange",
            label="training loss (mean since the last point)")
    ax.set(title=f"{title}: training", xlabel="global step", ylabel="loss")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if evaluations:
        right = ax.twinx()
        right.plot([p.global_step for p in evaluations], [p.value(metric) for p in evaluations],
                   marker="o", color="tab:blue", label=f"holdout {metric}")
        right.set_ylabel(metric)
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    fig.legend(handles, labels, loc="lower center", ncols=len(handles), frameon=False)  # below: no curve hidden
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
