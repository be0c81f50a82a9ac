"""`trnflow serve`'s polls for scheduled runs, in Prefect's own service loop, against an address
where no server answers: Prefect's poller gives up after three with their tracebacks; serve's waits
for the next, saying so in one line, and leaves judging the server to serve's watch."""

import socket

import anyio
import httpx
import prefect.runner.runner as runner_module
import pytest
from prefect.client.orchestration import PrefectClient
from prefect.runner._deployment_registry import DeploymentRegistry
from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
from prefect.utilities.services import critical_service_loop

from trnflow.flows import serving


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _polls(poller_class: type, printed: list[str], misses: int) -> object:
    """Prefect's service loop polling with `poller_class` until `misses` polls went unanswered (or
    the loop ends); the poller."""
    with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}):
        # without the transport's own three retries of a connection, 1.5 s a poll
        async with PrefectClient(f"http://127.0.0.1:{_closed_port()}/api",
                                 httpx_settings={"transport": httpx.AsyncHTTPTransport()}) as client:
            poller = poller_class(
                query_seconds=0.01, prefetch_seconds=10, client=client, limit_manager=None,
                deployment_registry=DeploymentRegistry(), resolve_starter=None, runs_task_group=None,
                storage_objs=[], process_manager=None, state_proposer=None, hook_runner=None,
                cancellation_manager=None, get_attempt_conclusion=lambda _: None)
            async with anyio.create_task_group() as group:
                group.start_soon(lambda: critical_service_loop(poller._get_and_submit_flow_runs, 0.01,
                                                               printer=lambda *a: printed.append(" ".join(a))))
                with anyio.fail_after(60):
                    while getattr(poller, "missed", 0) < misses:
                        await anyio.sleep(0.01)
                group.cancel_scope.cancel()
    return poller


def test_unanswered_polls_wait_for_the_next_and_say_so_in_one_line(monkeypatch, caplog):
    prefects = runner_module.ScheduledRunPoller
    printed: list[str] = []
    with pytest.raises(ExceptionGroup) as raised:  # Prefect's own: three misses end it, tracebacks printed
        anyio.run(_polls, prefects, printed, 1)
    assert "Service exceeded error threshold" in str(raised.value.exceptions[0])
    assert "Failed the last 3 attempts" in "".join(printed) and "Traceback" in "".join(printed)

    monkeypatch.setattr(runner_module, "ScheduledRunPoller", prefects)  # put back after the test
    serving._scheduled_polls_left_to_the_watch()
    ours = runner_module.ScheduledRunPoller
    assert issubclass(ours, prefects) and ours is not prefects
    serving._scheduled_polls_left_to_the_watch()  # once only
    assert runner_module.ScheduledRunPoller is ours

    printed.clear()
    caplog.set_level("WARNING", logger="prefect.runner")
    poller = anyio.run(_polls, ours, printed, 7)
    assert printed == [] and poller.missed >= 7
    said = [r.getMessage() for r in caplog.records if r.name == "prefect.runner"]
    assert said[:2] == [f"the Prefect server did not answer the last {n} polls for scheduled runs (ConnectError: "
                        f"All connection attempts failed); serve asks again every 2 s" for n in (3, 6)], said
    assert all(r.exc_info is None for r in caplog.records)
