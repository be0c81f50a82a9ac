"""A run's log says what happened: an outcome trnflow decided ends it without a traceback, and a
cancelled run reads as a cancellation, not a crash. Records made as Prefect's engines make them,
through the filter the flows install on their loggers."""

import inspect
import logging

import prefect
import prefect.flow_engine
import prefect.runner.runner
import prefect.states
import prefect.task_engine
import pytest
from prefect._internal import control_listener  # the private channel `cancelling` reads
from prefect.exceptions import FailedRun

from trnflow.errors import GateFailed
from trnflow.flows._stages import PipelineFailed, QuietExpectedFailures, cancelling

PREFECT_CHECKED = "3.8"
"""The Prefect release (major.minor) whose engines' messages and cancel channel were checked."""


def _record(message: str, error: BaseException | None = None, level: int = logging.ERROR) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error else None
    return logging.LogRecord("prefect.flow_runs", level, __file__, 1, message, (), exc_info)


def test_the_engine_exit_record_of_a_decided_outcome_is_dropped_and_a_bug_keeps_its_traceback():
    quiet = QuietExpectedFailures()
    gate = GateFailed("accuracy-parity gate failed")
    exit_message = "Engine execution exited with unexpected exception"
    for error in (PipelineFailed("evaluate", gate, []), gate, FailedRun("refused")):
        assert not quiet.filter(_record(exit_message, error))  # the run's own lines said why
    kept = _record("Task run encountered an exception", gate)
    assert quiet.filter(kept) and kept.exc_info is None  # said, without the internals
    bug = _record(exit_message, KeyError("step"))
    assert quiet.filter(bug) and bug.exc_info is not None


@pytest.fixture
def intent():
    """Prefect's runner intent, set as the runner sets it before it stops a cancelled run."""
    yield control_listener._set_intent
    control_listener.clear_intent()


def test_a_cancelled_run_reads_as_a_cancellation(intent):
    quiet = QuietExpectedFailures()
    crashed = _record("Crash detected! Execution was aborted by a termination signal.")
    running = _record("Finished in state Running()", level=logging.INFO)
    assert quiet.filter(crashed) and crashed.getMessage() == "Crash detected! Execution was aborted by a termination "\
        "signal."  # no cancel asked: a crash is a crash
    intent("cancel")
    assert cancelling()
    for record, said in ((crashed, "cancelled with its run"), (running, "Finished in state Cancelled()")):
        assert quiet.filter(record) and record.getMessage() == said and record.levelname == "INFO"


def test_prefects_private_cancel_channel_is_where_trnflow_reads_it():
    release = ".".join(prefect.__version__.split(".")[:2])
    assert release == PREFECT_CHECKED, (
        f"prefect {prefect.__version__} is installed; the cancel channel trnflow reads (`cancelling` in "
        f"trnflow/flows/_stages.py) and the engine messages it rewrites were checked against {PREFECT_CHECKED}: "
        "cancel a served run, read its log, then set PREFECT_CHECKED")
    assert callable(control_listener.get_intent)
    observer = prefect.runner.runner.FlowRunCancellingObserver  # serve keeps its polling at Prefect's default
    assert "polling_interval" in inspect.signature(observer.__init__).parameters
    poller = prefect.runner.runner.ScheduledRunPoller  # serve's polls leave a gone server to its watch
    assert inspect.iscoroutinefunction(poller._get_and_submit_flow_runs)
    said = {module.__name__: inspect.getsource(module) for module in (prefect.task_engine, prefect.flow_engine,
                                                                        prefect.states)}
    assert 'f"Crash detected! {state.message}"' in said["prefect.task_engine"]
    assert "Execution was aborted by a termination signal." in said["prefect.states"]
    assert 'msg = "Flow run was cancelled."' in said["prefect.flow_engine"]
