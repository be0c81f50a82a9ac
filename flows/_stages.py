"""Running stages one after another, recording a summary row for each, and stopping at the first
failure with the rows so far."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

from prefect import get_run_logger
from prefect.exceptions import FailedRun, TerminationSignal
from prefect.runtime import flow_run
from prefect.states import Failed, State

try:
    from prefect._internal.control_listener import get_intent  # private: tests/unit/test_run_log.py checks it
except ImportError:  # another Prefect: the log says what its engines say
    get_intent = None

from trnflow.backends import claim_run, run_queue, trusted_cache_keys
from trnflow.backends.admission import MAX_PREEMPTIONS
from trnflow.backends.runqueue import Ticket
from trnflow.device.plans import cache_problem
from trnflow.device.signing import UNSIGNED_ENV
from trnflow.errors import FatalError, GateDecision, OverBudget, Preempted, TrnflowError
from trnflow.flows._lock import holder_label
from trnflow.flows._queue import PREFECT_QUEUE
from trnflow.lifecycle.locations import check_locations
from trnflow.neuron.launch import format_cores
from trnflow.reporting.budget import over_daily_spend, over_limits, training_budget
from trnflow.reporting.cost import run_cost, stage_cost
from trnflow.reporting.forecast import OVERRIDE_HINT, Plan, beside, launch_forecast
from trnflow.reporting.goodput import goodput
from trnflow.reporting.history import keep
from trnflow.reporting.ledger import JobLedger
from trnflow.reporting.report import cost_markdown, links_markdown, outputs, stage_summary, with_not_run
from trnflow.reporting.tensorboard import write_events
from trnflow.reporting.tracking import mirror
from trnflow.results import (
    QUEUE_ROW,
    Cost,
    CostRow,
    EvaluateResult,
    RunOutcome,
    SanityResult,
    StageResult,
    StageRow,
    TrainResult,
)
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec, SpecError, new_run_id, run_id_problem
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import PREEMPTED, WAITING, release_kept, running_as
from trnflow.tasks.collectives import collective_test
from trnflow.tasks.compile import compile_graphs
from trnflow.tasks.retry_policy import retry_options
from trnflow.tasks.sanity import sanity_check
from trnflow.tasks.train import train_model

PIPELINE_STAGES = ("sanity", "collectives", "compile", "train", "evaluate", "infer", "promote")
"""The stages of a training run, a first one (`pipeline`) or a retraining, in order."""

STAGE_COLUMNS = {"stage": "stage", "state": "state", "seconds": "seconds", "device": "device", "summary": "key figure"}
"""The `<name>-stages` table artifact's columns, by the `StageRow` field each shows."""


class PipelineFailed(Exception):
    """A stage failed. `stages` has a row per stage that ran; `cause` is the stage's own error."""

    def __init__(self, stage: str, cause: BaseException, stages: list[StageRow]):
        super().__init__(f"stage {stage} failed: {cause}")
        self.stage, self.cause, self.stages = stage, cause, stages


class QuietExpectedFailures(logging.Filter):
    """Keeps a run's log to what happened. Drops the traceback Prefect's engine logs with a failed
    task or flow when the error is one of trnflow's own (a job's failure, a refused spec, a check
    before launch): its message says what happened and what to do, and the traceback would only
    show Prefect's and trnflow's internals. Any other error (a bug) keeps its traceback.

    A served run's engine logs the run's failure once more as it exits ("Engine execution exited
    with unexpected exception", with the final state's error: `FailedRun`, a `PipelineFailed` or
    trnflow's own): the run's own lines said why already, and its state is named for the outcome, so
    that record is dropped. A run cancelled from the UI or `trnflow cancel` (`cancelling`) reads as
    a cancellation: the stage it interrupted was cancelled, not crashed, and the run ends Cancelled."""

    EXPECTED = (TrnflowError, SpecError)
    CANCELLED: ClassVar[dict[str, str]] = {
        "Crash detected! Execution was aborted by a termination signal.": "cancelled with its run",
        "Finished in state Crashed('Execution was aborted by a termination signal.')": "Finished in state Cancelled()",
        "Finished in state Running()": "Finished in state Cancelled()"}
    """What Prefect's engines log as a runner's cancellation stops them, and what it means."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (FailedRun, PipelineFailed, *self.EXPECTED)) and record.getMessage().startswith(
                "Engine execution exited"):
            return False
        if isinstance(error, self.EXPECTED):
            record.exc_info, record.exc_text = None, None
        said = self.CANCELLED.get(record.getMessage()) if record.levelno >= logging.INFO else None
        if said is not None and cancelling():  # the intent is read only for the few lines it could change
            record.msg, record.args, record.levelno, record.levelname = said, (), logging.INFO, "INFO"
        return True


def cancelling() -> bool:
    """Whether the runner that started this flow run is cancelling it (the UI's Cancel, `trnflow
    cancel`): the intent Prefect's runner sends its flow run's process before it stops it. False
    where this Prefect has no such channel (the log then says what Prefect's engines say)."""
    return get_intent is not None and get_intent() == "cancel"


ENGINE_LOGGERS = ("prefect.task_runs", "prefect.flow_runs")
"""The loggers Prefect's task and flow engines report failures on."""
for _name in ENGINE_LOGGERS:
    if not any(isinstance(f, QuietExpectedFailures) for f in logging.getLogger(_name).filters):
        logging.getLogger(_name).addFilter(QuietExpectedFailures())


class StageRunner:
    """Calls each stage task with the spec's retry policy; keeps rows and results."""

    def __init__(self, spec: JobSpec, run_id: str):
        if problem := run_id_problem(run_id):
            raise ValueError(f"run id {problem}")
        self.spec, self.run_id = spec, run_id
        self.team = claim_run(spec, run_id)  # its team decided, the spec inside it, the run id its own
        """The run's team, decided once: every stage's jobs are its (`team=stage.team`)."""
        self.rows: list[StageRow] = []
        self.results: dict[str, StageResult] = {}
        self.costs: list[CostRow] = []
        self.ledger = JobLedger(TrnflowSettings().home, run_id)
        self.ledger.new_entries()  # jobs of an earlier flow run with this id were costed by that run
        self._options = retry_options(spec)
        self.notes: list[str] = []
        """What the run's summary says under its heading (a cache used unsigned)."""
        self.ended: str | None = None
        """How the run ended when it did not complete, in one line (its final state's message)."""
        self.forecast: Plan | None = None
        """The run's forecast, made before its first job (`check_limits`)."""
        self.ticket: Ticket | None = None
        """The run's place in this machine's queue, while it runs on its cores (`admitted`)."""
        self.yielded = 0
        """How often it gave up its cores to a higher-priority run."""
        self._reason = ""

    def __call__(self, name: str, task, *args, **kwargs) -> StageResult:
        """Run stage `name`'s task on the run's spec, as its user wrote it."""
        began = time.monotonic()
        try:
            state = task.with_options(**self._options)(self.spec, self.run_id, *args, return_state=True,
                                                       **kwargs)
        except TerminationSignal:  # the run was cancelled (or its process stopped) while the stage ran
            cancelled = cancelling()
            said = "cancelled while it ran" if cancelled else "stopped while it ran: its process was ended"
            self.rows.append(StageRow(stage=name, state="Cancelled" if cancelled else "Crashed",
                                      seconds=time.monotonic() - began, summary=said))
            self.ended = "Cancelled" if cancelled else f"{name} {said}"
            raise
        seconds = time.monotonic() - began
        billed = self.ledger.new_entries()  # every job the stage ran, its retries' included
        preempted = state.is_failed() and isinstance(state.result(raise_on_failure=False), Preempted)
        if billed:  # each job on the nodes it held; the part of a stage that yielded, on a row of its own
            self.costs.append(stage_cost(self.spec, f"{name} (preempted)" if preempted else name, billed))
        if state.is_completed():
            result = state.result()
            label = "Skipped" if state.name == "Skipped" else "Completed"
            self.rows.append(StageRow(stage=name, state=label, seconds=seconds, summary=result.summary,
                                      device=result.device.name if result.device else ""))
            self.results[name] = result
            if isinstance(result, EvaluateResult) and result.kept is not None:  # passed, but the champion stays
                raise PipelineFailed(name, result.kept.error(), self.rows)
            return result
        error = state.result(raise_on_failure=False)
        label = "Preempted" if preempted else state.type.value.title()
        self.rows.append(StageRow(stage=name, state=label, seconds=seconds, summary=str(error)))
        raise PipelineFailed(name, error, self.rows)

    @contextlib.contextmanager
    def admitted(self, trains: bool) -> Iterator[None]:
        """Hold the run's place on its capacity for the whole block (`run_queue`): on this machine, its
        cores from its first stage to its last; in the cloud, its instances of a type the teams file
        limits. Waited for at the run's level with the reason as the flow run's state (`Waiting`),
        never with a stage's retries. A run that `trains` can be asked to yield until its training
        has ended; any other cannot."""
        forecast = self.forecast
        self.ticket = run_queue(self.spec, self.run_id, self.team, holder_label(self.run_id), PREFECT_QUEUE,
                                forecast.seconds if forecast else None, preemptible=trains,
                                cost_usd=forecast.cost_usd if forecast else None)
        if self.ticket is None:
            yield
            return
        try:
            self._wait_turn()
            yield
        finally:
            self.ticket.release(self.cost().total_usd)  # its team's spend today

    def _wait_turn(self) -> None:
        """Wait until admitted; time spent waiting is a `queue` row of the stage table."""
        assert self.ticket is not None
        began, self._reason = time.monotonic(), ""
        self.ticket.wait(self._waiting)
        waited = time.monotonic() - began
        if self._reason:
            where = format_cores(self.ticket.cores) if self.ticket.cores else self.ticket.entry.pool
            self.rows.append(StageRow(stage=QUEUE_ROW, state="Waited", seconds=waited,
                                      summary=f"{self._reason}; then admitted on {where}"))
            running_as("Running", f"admitted after waiting {waited:.0f} s", get_run_logger())

    def _waiting(self, reason: str) -> None:
        self._reason = reason
        get_run_logger().info(f"waiting: {reason}")
        running_as(PREEMPTED if self.yielded else WAITING, f"waiting: {reason}", get_run_logger())

    def past_yielding(self) -> None:
        """Training has ended: the run can no longer yield at a step boundary, and is never asked."""
        if self.ticket is not None:
            self.ticket.past_yielding()

    def held(self, cores: list[int]) -> list[int]:
        """`cores`, or where the run holds its cores now when it moved off them (a core that failed
        in training): the cores its later stages run on."""
        if self.ticket is None or set(cores) <= set(self.ticket.cores):
            return cores
        return self.ticket.cores[: len(cores)]

    def asked_to_yield(self) -> bool:
        """Whether a higher-priority run asked this one for its cores."""
        return self.ticket is not None and self.ticket.asked_to_yield() is not None

    def requeue(self, cores: list[int], when: str) -> list[int]:
        """Give up the run's cores (it was asked to yield), queue again at its first arrival, and
        wait to be admitted. The cores to go on with: these, or others checked by the preflight."""
        assert self.ticket is not None
        asked = self.ticket.asked_to_yield()
        who = f"{asked.label} ({asked.priority_class})" if asked else "a higher-priority run"
        self.yielded += 1
        note = f"yielded its {self.ticket.entry.unit}s to {who} {when}; queued again"
        if self.ticket.entry.preemptions + 1 >= MAX_PREEMPTIONS:
            note += (f" (it has yielded {self.ticket.entry.preemptions + 1} times: a higher class of its team no "
                     "longer asks it; capacity it borrowed still goes back)")
        get_run_logger().warning(note)
        self.notes.append(note)
        running_as(PREEMPTED, note, get_run_logger())
        self.ticket.requeue(self.cost().total_usd)  # what it spent so far is its team's spend today
        self._wait_turn()
        running_as("Running", f"admitted again after yielding to {who}", get_run_logger())
        if self.ticket.cores == cores or self.ticket.entry.unit != "core":  # the cloud's next job: new instances
            return cores
        get_run_logger().info(f"admitted on other cores ({format_cores(self.ticket.cores)}): the preflight "
                              "checks them first")
        return preflight_stages(self, then_train=True)

    def check_cache(self, when: str) -> None:
        """FatalError when the spec's compile cache cannot be trusted: a local folder that is not this
        user's alone (`cache_problem`), or a shared one nothing checks (`trusted_cache_keys`). A shared
        cache used unsigned by choice (TRNFLOW_CACHE_UNSIGNED) is said in the log and the summary."""
        spec = self.spec
        if problem := cache_problem(spec):
            raise FatalError(f"{when}: {problem}")
        try:
            keys = trusted_cache_keys(spec, team=self.team)  # for a cloud spec, the deployment's settings: read once
        except FatalError as exc:
            raise FatalError(f"{when}: {exc}") from None
        if spec.compile.cache_url.startswith("s3://") and not keys.checks:
            note = (f"compile cache {spec.compile.cache_url} is used unsigned ({UNSIGNED_ENV}): its entries are "
                    "not checked, and anyone who can write it can change the code every job loads")
            get_run_logger().warning(note)
            self.notes.append(note)

    def check_limits(self, override: str | None) -> None:
        """Forecast the run (its first log line) and refuse it, before its first job, when the
        forecast misses the spec's deadline or budget (`over_limits`), unless `override` says why it
        should go on (then the log and the summary say so)."""
        home = TrnflowSettings().home.expanduser().resolve()
        self.forecast, line = launch_forecast(self.spec, home)
        get_run_logger().info(line)
        problems = over_limits(self.spec, self.forecast)
        if refused := over_daily_spend(self.team, self.forecast):  # no override: the team's, not the run's
            raise FatalError(f"refused before its first job: {refused}")
        if problems and not (override or "").strip():
            raise FatalError(f"refused before its first job: {'; '.join(problems)}; {OVERRIDE_HINT}")
        if problems:
            note = f"launched past its forecast limits ({'; '.join(problems)}), because: {override}"
            get_run_logger().warning(note)
            self.notes.append(note)

    def training_budget(self) -> float | None:
        """What the training job may cost (`training_budget`: what the run's budget leaves for it, or
        the spec's train.max_cost_usd), given to its job as its budget: the spec stays as written.
        None: no limit. OverBudget when nothing is left."""
        allowance, basis = training_budget(self.spec, self.forecast, self.cost().total_usd or 0.0)
        if allowance is None:
            return None
        if allowance <= 0:
            error = OverBudget(f"nothing is left of the budget for training: {basis}; rerun with the same run id "
                               "and a higher compute.max_cost_usd")
            self.rows.append(StageRow(stage="train", state="Failed", seconds=0.0, summary=str(error)))
            raise PipelineFailed("train", error, self.rows)
        get_run_logger().info(f"budget: training may cost ${allowance:.4f} ({basis})")
        return allowance

    def budget_left(self) -> float | None:
        """What the run's budget leaves now for another training (the reference's, `gate.reference:
        auto`), reckoned as training's was; None: no limit. Its job stops, OverBudget, where that
        is not enough."""
        allowance, _ = training_budget(self.spec, self.forecast, self.cost().total_usd or 0.0)
        return None if allowance is None else max(allowance, 0.0)

    def bill(self, name: str) -> None:
        """Cost the jobs recorded since the last stage ended (a job let go after it) as `name`'s."""
        billed = self.ledger.new_entries()
        if billed:
            self.costs.append(stage_cost(self.spec, name, billed))

    def skip(self, name: str, reason: str) -> None:
        """Record a stage that did not run because there was nothing for it to do."""
        self.rows.append(StageRow(stage=name, state="Skipped", seconds=0.0, summary=reason))

    def report(self, stages: tuple[str, ...] = ()) -> None:
        """Attach the run's summary to the flow run: the stage table, the cost table and links to
        what it wrote. Called however the run ended; a failure to publish is only logged."""
        title = f"{self.spec.name} run {self.run_id}"
        stages = stages or tuple(r.stage for r in self.rows)
        text = stage_summary(title, self.rows, stages, self.ended, self.notes)
        if self.costs:
            text += "\n" + cost_markdown(self.cost())
        links = outputs(self.results)
        if links:
            text += "\n" + links_markdown(links)
        home, outcome = TrnflowSettings().home.expanduser().resolve(), self.outcome()
        if self.spec.tracking.mlflow_uri:  # mirrored however it ended; a server that is down never fails it
            sent, note = mirror(self.spec, outcome, self.ended, text, flow_run.get_flow_run_ui_url(), home,
                                self.team)
            (get_run_logger().info if sent else get_run_logger().warning)(note)
            text += f"\n{note}\n"
        if self.spec.tracking.tensorboard and "train" in self.results:
            try:
                note = write_events(self.spec, outcome)
                get_run_logger().info(note)
            except Exception as exc:  # a store that refuses costs the run only its event file
                note = f"tensorboard: no event file written ({type(exc).__name__}: {one_line(exc)})"
                get_run_logger().warning(note)
            text += f"\n{note}\n"
        if self.ended is None:  # what it measured, for the forecasts of later runs
            try:
                if kept := keep(self.spec, outcome, home, self.forecast):
                    get_run_logger().info(f"history: this run's measurements kept in {kept}")
            except Exception as exc:  # a store that refuses costs later forecasts one run, never this run
                get_run_logger().warning(f"history: this run's measurements not kept ({one_line(exc)})")
        _artifacts.markdown(self.spec, "summary", text, f"stages, cost and outputs of run {self.run_id}")
        _artifacts.table(self.spec, "stages", [{STAGE_COLUMNS[k]: _cell(getattr(r, k)) for k in STAGE_COLUMNS}
                                                for r in with_not_run(self.rows, stages, self.ended)],
                         f"each stage's state, duration and key figure in run {self.run_id}")

    def cost(self) -> Cost:
        """The run's cost table so far, with the forecast beside each stage, and its goodput once
        training ended."""
        train = self.results.get("train")
        measured = goodput(self.rows, train if isinstance(train, TrainResult) else None, self.costs)
        return beside(run_cost(self.costs), self.forecast).model_copy(update={"goodput": measured})

    def outcome(self) -> RunOutcome:
        return RunOutcome(run_id=self.run_id, stages=self.rows, results=self.results, cost=self.cost())


def _cell(value: object) -> object:
    """A stage table cell: seconds to a tenth (3.8, not 3.8351991310000813)."""
    return round(value, 1) if isinstance(value, float) else value


def one_line(error: BaseException) -> str:
    """An error's message as one line (a state message; the UI shows its first 70 or so characters)."""
    return " ".join(str(error).split()) or type(error).__name__


def failed_state(error: PipelineFailed | TrnflowError) -> State:
    """The final state of a run that `error` ended, its reason in one line as the message (the UI's
    runs list and run page show it): `train failed: ...`, or the check that stopped it before its
    first job. A failed gate ends it in a state of its own, `GateFailed`, and a candidate worse than
    the champion in `ChampionKept`, so that the UI, the API and `trnflow submit --wait` (exit 3 and
    5) tell them apart from a broken run; their message is the decision's reason. The state's data
    is the error."""
    cause = error.cause if isinstance(error, PipelineFailed) else error
    if isinstance(cause, GateDecision):
        return Failed(name=type(cause).__name__, message=cause.headline, data=error)
    if isinstance(cause, OverBudget):
        return Failed(name="OverBudget", message=one_line(cause), data=error)
    return Failed(message=f"{error.stage} failed: {one_line(cause)}" if isinstance(error, PipelineFailed)
                  else one_line(error), data=error)


def run_stages(stage: StageRunner, body: Callable[[StageRunner], RunOutcome], stages: tuple[str, ...],
               override_forecast: str | None = None) -> RunOutcome:
    """Run a flow's stages and attach its summary, however it ends: a run that failed says why in
    its first line (`failed_state`'s message), and each stage that did not run says why not. A run
    that trains is forecast first, and refused when it would miss its deadline or budget
    (`StageRunner.check_limits`), unless `override_forecast` says why not."""
    try:
        if "train" in stages:  # the run's first line: how long it should take and cost (`trnflow plan`)
            stage.check_limits(override_forecast)
        with stage.admitted(trains="train" in stages):
            return body(stage)
    except (PipelineFailed, TrnflowError) as exc:
        state = failed_state(exc)
        stage.ended = state.message if state.name == "Failed" else f"{state.name}: {state.message}"
        raise
    finally:
        stage.report(stages)


def preflight_stages(stage: StageRunner, then_train: bool = False) -> list[int]:
    """Sanity, then collectives: the cores verified. The sanity job sweeps the collectives too, and
    the collectives stage judges its sweep, so preflight starts one job, not two. With
    `then_train`, training runs on the instances checked (where the backend allocates them per job)."""
    checked = stage("sanity", sanity_check, then_train=then_train, team=stage.team)
    assert isinstance(checked, SanityResult)
    stage("collectives", collective_test, checked.cores or [], swept=checked.collectives, team=stage.team)
    return checked.cores or []


def through_training(stage: StageRunner, later: tuple[str, ...], retraining: bool = False
                     ) -> tuple[list[int], TrainResult]:
    """Sanity, collectives, compile and train: the cores verified and the training result. When
    training found no new data, the `later` stages are recorded as skipped. `retraining`: the gate
    will judge the final point only, so the reference's steps need not be the run's."""
    check_locations(stage.spec, retraining)  # a location it cannot write fails the run now, not after training
    stage.check_cache("before training")  # nor a cache it cannot trust
    try:
        cores = preflight_stages(stage, then_train=True)
        if stage.asked_to_yield():
            cores = stage.requeue(cores, "before compiling")
        stage("compile", compile_graphs, cores, team=stage.team)
        budget, mark = stage.training_budget(), stage.ledger.read_up_to  # one budget, however often it yields
        while True:  # a run asked to yield gives up its cores at a step boundary, and resumes from there
            if stage.asked_to_yield():
                cores = stage.requeue(cores, "before training")
            try:
                trained = stage("train", train_model, cores, ledger_mark=mark, budget_usd=budget, team=stage.team)
                break
            except PipelineFailed as exc:
                if not isinstance(exc.cause, Preempted):
                    raise
                cores = stage.requeue(cores, "during training")
        stage.past_yielding()
    finally:  # instances kept for training that will not come (a failed stage, a stopped run) are let go
        if release_kept(stage.run_id, "the run stopped before training"):
            stage.bill("sanity")  # billed to the stage that started them
    assert isinstance(trained, TrainResult)
    if trained.skipped:
        for name in later:
            stage.skip(name, "no new model: training was skipped")
    return stage.held(cores), trained


def flow_run_id() -> str:
    """A new run id for the current flow run, ending with the start of its Prefect id."""
    prefect_id = flow_run.get_id()
    return new_run_id(str(prefect_id)[:8] if prefect_id else None)
