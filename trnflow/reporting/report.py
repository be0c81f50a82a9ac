"""Markdown for what a run shows in the Prefect UI: the stage summary, the preflight and collective
tables, the compile cache's hits and misses, the cost table and the links to what was written.
Pure functions of the stage results; the tasks and flows publish them as artifacts, and the rows
they share with the command's rich tables (`trnflow.cli.render`) are made here once."""

from __future__ import annotations

from trnflow.measures import CoreChecks
from trnflow.reporting.cost import spot_savings
from trnflow.results import CollectivesResult, CompileResult, Cost, CostRow, StageResult, StageRow, TrainResult
from trnflow.urls import shown

ENGINES = ("tensor", "vector", "scalar", "gpsimd", "memory")


PASSING = ("Waited", "Preempted")
"""Row states that did not end the run: its time in the queue, a stage it yielded and ran again."""


def with_not_run(rows: list[StageRow], stages: tuple[str, ...], stopped: str | None = None) -> list[StageRow]:
    """The stage rows, then a NotRun row for each stage that never ran, saying why: the stage that
    ended the run, or `stopped` (why it ended before its first stage)."""
    seen = {r.stage for r in rows}
    ended = next((r for r in rows if r.state not in ("Completed", "Skipped", *PASSING)), None)
    why = (f"not run: {ended.stage} {ended.state.lower()}" if ended
           else f"not run: {stopped}" if stopped else "not run: the run stopped before it")
    return rows + [StageRow(stage=s, state="NotRun", summary=why) for s in stages if s not in seen]


def engine_outcomes(core: CoreChecks) -> list[tuple[int, list[str]]]:
    """Per engine, in ENGINES order: how many tests ran, and the `test/dtype` of each that failed."""
    out = []
    for engine in ENGINES:
        checks = [c for c in core.checks if c.engine == engine]
        out.append((len(checks), [f"{c.test}/{c.dtype}" for c in checks if not c.passed]))
    return out


COST_COLUMNS = ("stage", "instance type", "nodes", "jobs", "instances started", "provisioning s", "$/node-hour",
                "priced as", "billable s", "forecast s", "cost ($)", "forecast ($)")
"""The cost table's columns, the Markdown summary's and the command's alike."""
CLOUD_COLUMNS = ("instances started", "provisioning s")
"""Columns shown only for a run whose jobs started cloud instances."""
FORECAST_COLUMNS = ("forecast s", "forecast ($)")
"""Columns shown only for a run forecast before it started: the forecast beside the actual."""
_ALIGN = dict(zip(COST_COLUMNS, ["---", "---", "---:", "---:", "---:", "---:", "---:", "---", "---:", "---:", "---:",
                                 "---:"], strict=True))


def cost_columns(cost: Cost) -> list[str]:
    """The columns of this run's cost table: a local run's has no instance counts to show, a run
    made without a forecast no forecast."""
    return [c for c in COST_COLUMNS if (c not in CLOUD_COLUMNS or cost.instances_started is not None)
            and (c not in FORECAST_COLUMNS or any(r.forecast_seconds is not None for r in cost.rows))]


def _shown(cost: Cost, cells: list[str]) -> list[str]:
    """A full row's cells (`COST_COLUMNS`) under this run's columns."""
    columns = cost_columns(cost)
    return [cell for name, cell in zip(COST_COLUMNS, cells, strict=True) if name in columns]


def price_basis(row: CostRow) -> str:
    """Where a row's price comes from: the service, region and day of the catalogue's figure, the
    spec's own price, or none known. A price is only as good as these, so the table shows them."""
    if row.price_per_node_hour is None:
        return f"{row.service or 'on-demand'}: no price known"
    spot = "" if row.on_demand_usd is None else (
        "; spot: EC2's spot price at each instance's launch" if row.service == "ec2" else
        "; spot: the service's billable time")
    if row.region is None:
        return f"compute.price_per_hour{spot}"
    return f"{row.service} {row.region}, {row.price_as_of}{spot}"


def cost_cells(cost: Cost) -> tuple[list[list[str]], str]:
    """Each job's row of the cost table as text (`cost_columns`), and the run's total."""
    rows = [_shown(cost, [
        r.stage, f"ml.{r.instance_type}" if r.service == "sagemaker" else r.instance_type, str(r.nodes), str(r.jobs),
        "-" if r.instances_started is None else str(r.instances_started),
        "-" if r.provisioning_seconds is None else f"{r.provisioning_seconds:.1f}",
        "unknown" if r.price_per_node_hour is None else f"{r.price_per_node_hour:.7g}",
        price_basis(r), f"{r.billable_seconds:.1f}", _figure(r.forecast_seconds, ".1f"),
        "unknown" if r.cost_usd is None else f"{r.cost_usd:.4f}", _figure(r.forecast_usd, ".4f")])
        for r in cost.rows]
    total = cost.total_usd
    return rows, "unknown (set compute.price_per_hour)" if total is None else f"{total:.4f}"


def _figure(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def total_cells(cost: Cost, total: str) -> list[str]:
    """The cost table's last row after its label: the instances the run started and the time they
    took to be ready (where it started any), the run's cost and its forecast."""
    started = "" if cost.instances_started is None else str(cost.instances_started)
    waited = "" if cost.provisioning_seconds is None else f"{cost.provisioning_seconds:.1f}"
    return _shown(cost, ["", "", "", "", started, waited, "", "", "", "", total, _figure(cost.forecast_usd, ".4f")])[1:]


def _table(header: list[str], rows: list[list[str]], align: list[str] | None = None) -> list[str]:
    align = align or ["---"] * len(header)
    cells = [[str(c).replace("|", "\\|") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|",
            *("| " + " | ".join(r) + " |" for r in cells)]


def stage_summary(title: str, rows: list[StageRow], stages: tuple[str, ...], ended: str | None = None,
                  notes: list[str] | None = None) -> str:
    """One line per stage: state, duration and key figure; stages that never ran say NotRun and why.
    `ended`: how a run that did not complete ended, in one line, put in the first line. `notes`:
    what the run needs said before its stages (a cache used unsigned), each a warning line. A list,
    not a table: a key figure is a sentence, and the UI's tables do not wrap their cells (the
    `<name>-stages` table artifact has the same rows as columns)."""
    lines = [f"- **{r.stage}**, {r.state if r.state == 'Completed' else f'*{r.state}*'}"
             f"{'' if r.seconds is None else f' in {r.seconds:.1f} s'}: {r.summary}"
             for r in with_not_run(rows, stages, ended)]
    heading = f"## {title}: {ended}" if ended else f"## {title}"
    warned = [line for note in notes or [] for line in (f"> **Warning:** {note}", "")]
    return "\n".join([heading, "", *warned, *lines]) + "\n"


def loss_figure(result: TrainResult) -> str:
    """The train stage's loss, named for what it is: the last point of the training curve, which is
    rank 0's mean loss over the steps since the point before (`train.log_every` of them), the
    number the run's last `train` log line and the training chart end on, with those steps named:
    `loss 0.2377 (mean of steps 151-200)`. The result's own `loss` is the last step's alone, one
    batch and noisier; it is shown, named so, only for a run with no curve."""
    if not result.curve:
        return "loss unknown" if result.loss is None else f"loss {result.loss:.4f} (the last step's)"
    *earlier, last = result.curve
    before = earlier[-1].step if earlier else 0
    if last.step > result.start_step:  # logged by this attempt, whose window began where it resumed
        before = max(before, result.start_step)
    first = before + 1
    which = f"step {first}" if first == last.step else f"mean of steps {first}-{last.step}"
    return f"loss {last.loss:.4f} ({which})"


def sanity_markdown(per_core: list[CoreChecks], excluded: list[int], cores: list[int]) -> str:
    """Known-answer tests per core and engine: ok (tests run) or the tests that failed; then the bad
    cores `excluded` and the `cores` the later stages ran on."""
    rows = [[f"nc{core.core}", *("**FAIL** " + ", ".join(failed) if failed else f"ok ({ran})"
                                    for ran, failed in engine_outcomes(core))] for core in per_core]
    lines = ["## Hardware sanity: known-answer tests per engine", "", *_table(["core", *ENGINES], rows)]
    if excluded:
        lines += ["", f"Excluded bad core(s): {excluded}; later stages ran on {cores}."]
    return "\n".join(lines) + "\n"


def collectives_markdown(result: CollectivesResult) -> str:
    """The nccom-test-style sweep: size, time, algbw and busbw per op, and whether the answers were right."""
    rows = []
    for r in result.rows:
        verdict = r.verdict
        rows.append([r.op, f"{r.size:,}", r.type, f"{r.time_us:.0f}", f"{r.algbw:.3f}", f"{r.busbw:.3f}",
                     f"**{verdict}**" if verdict == "WRONG" else verdict])
    lines = [f"## Collectives on {result.ranks} cores", "",
             *_table(["op", "size (B)", "dtype", "time:avg (us)", "algbw (GB/s)", "busbw (GB/s)", "result"], rows,
                     ["---", "---:", "---", "---:", "---:", "---:", "---"])]
    averages = result.avg_busbw_by_op
    if averages:
        lines += ["", "Average bus bandwidth: " + ", ".join(f"{op} {bw:.3f} GB/s" for op, bw in averages.items())]
    if result.plans:
        size = result.plans[0].size
        lines += ["", f"What each algorithm costs at {size:,} B:", "",
                  *_table(["op", "algorithm", "steps", "crossing nodes", "bytes sent per rank", "bus factor"],
                          [[p.op, p.algorithm, str(p.steps), str(p.crossing_steps), f"{p.bytes_per_rank:,}",
                            f"{p.bus_factor:.3f}"] for p in result.plans],
                          ["---", "---", "---:", "---:", "---:", "---:"])]
    return "\n".join(lines) + "\n"


def compile_markdown(result: CompileResult) -> str:
    """Each program's cache key and what happened to it: a hit, compiled, or failed."""
    report = result.report
    rows = []
    for program in result.programs:
        done = report.get(program.key)
        rows.append([program.program, program.shapes, f"`{program.key}`",
                     done.status if done else program.state or "", f"{done.seconds if done else 0.0:.1f} s"])
    lines = [f"## Compile cache {result.cache}", "",
             f"{result.hits} hit(s), {result.compiled} compiled", "",
             *_table(["program", "input shapes", "key", "outcome", "time"], rows)]
    return "\n".join(lines) + "\n"


def cost_markdown(cost: Cost) -> str:
    """The cost table as a list, a line per stage (its instances and their price, jobs, billable
    time and cost, with the forecast beside them), then the total: it fits a narrow page, where the
    command's table (`cost_cells`) would be cut off."""
    lines = [f"- **{r.stage}**: {_instances(r)}, {r.jobs} job{'s' if r.jobs != 1 else ''}, "
             f"{r.billable_seconds:.1f} s billable{_started(r.instances_started, r.provisioning_seconds)}: "
             f"**{'cost unknown' if r.cost_usd is None else f'${r.cost_usd:.4f}'}**{_forecast(r)}" for r in cost.rows]
    total = ("unknown (set compute.price_per_hour)" if cost.total_usd is None else f"${cost.total_usd:.4f}")
    lines += ["", f"Total: **{total}**{'' if cost.forecast_usd is None else f' (forecast ${cost.forecast_usd:.4f})'}"
              f"{_started(cost.instances_started, cost.provisioning_seconds)}."]
    note = spot_note(cost)
    lines += ["", f"Goodput: {cost.goodput} (the training the final weights hold, over the compile and train "
              "stages' time)."] if cost.goodput else []
    return "\n".join(["## What the jobs cost (on-demand prices)", "", *lines, *(["", note] if note else [])]) + "\n"


def _forecast(row: CostRow) -> str:
    """` (forecast 4.0 s, $0.0015)` beside a row forecast before the run (no price: none in dollars)."""
    if row.forecast_seconds is None:
        return ""
    return f" (forecast {row.forecast_seconds:.1f} s{'' if row.forecast_usd is None else f', ${row.forecast_usd:.4f}'})"


def _instances(row: CostRow) -> str:
    """`2x trn1.32xlarge at $21.5 per node-hour (ec2 us-east-1, 2026-08-26)`."""
    name = f"ml.{row.instance_type}" if row.service == "sagemaker" else row.instance_type
    if row.price_per_node_hour is None:
        return f"{row.nodes}x {name} ({price_basis(row)})"
    return f"{row.nodes}x {name} at ${row.price_per_node_hour:.7g} per node-hour ({price_basis(row)})"


def _started(instances: int | None, seconds: float | None) -> str:
    """`; 4 instances started, 180.0 s to provision` where the jobs started cloud instances."""
    if instances is None:
        return ""
    return f"; {instances} instance{'s' if instances != 1 else ''} started" + (
        "" if seconds is None else f", {seconds:.1f} s to provision")


def spot_note(cost: Cost) -> str | None:
    """`Spot saved $12.34 (70%) against on-demand.` when jobs ran on spot."""
    found = spot_savings(cost)
    if found is None:
        return None
    saved, share = found
    return f"Spot saved ${saved:,.2f} ({share:.0%}) against the same running time on demand."


def outputs(results: dict[str, StageResult]) -> list[tuple[str, str]]:
    """(what, URL) for everything the run wrote that a person may want to open."""
    found = []
    train, gate, infer, compiled = (results.get(stage) for stage in ("train", "evaluate", "infer", "compile"))
    if getattr(train, "checkpoint", None):
        found.append(("final checkpoint", train.checkpoint))
    if getattr(train, "series", None):
        found.append(("metric series", train.series))
    if getattr(gate, "chart", None):
        found.append(("parity chart", gate.chart))
    if getattr(infer, "output_url", None):
        found.append(("embeddings", infer.manifest or infer.output_url))
    if getattr(compiled, "cache", None):
        found.append(("compile cache", compiled.cache))
    return found


def location_markdown(url: str) -> str:
    """A location in Markdown: an S3 one a link to its console page, a local one its plain path
    (a `file://` link on the UI's page would open nothing)."""
    text, href = shown(url)
    return f"[{text}]({href})" if href else f"`{text}`"


def links_markdown(links: list[tuple[str, str]]) -> str:
    return "\n".join(["## Outputs", "", *(f"- {what}: {location_markdown(url)}" for what, url in links)]) + "\n"
