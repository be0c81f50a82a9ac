"""One training run per model at a time, whatever started it (a schedule, the UI, the CLI; the
pipeline or scheduled retraining): a Prefect global concurrency limit of one slot per model, held
for the whole run. The run holding it is named in a Prefect variable beside it, so that a run that
waits or is refused can say which run it is waiting for.

The slot is a lease. The run renews it every `RENEW_EVERY_SECONDS` and, when the server does not
answer, keeps trying until the lease would have run out: a server restart shorter than that costs
nothing. A run whose process dies gives the slot back once the lease runs out (`LEASE_SECONDS`,
plus the server's lease check). A lease that was lost (the server unreachable for longer, or a
restart of a server that keeps leases in memory) is noticed, and `ModelLock.check` refuses the
step that must not run unguarded: promotion. A slot a lost lease left taken is freed by hand with
`prefect gcl update trnflow-model-<model> --active-slots 0`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound, PrefectHTTPStatusError
from prefect.logging import get_run_logger
from prefect.runtime import flow_run
from prefect.variables import Variable

from trnflow.errors import FatalError
from trnflow.processes import pid_alive
from trnflow.specs import JobSpec
from trnflow.tasks._jobs import WAITING, running_as
from trnflow.teams import Team

LEASE_SECONDS = 120.0
RENEW_EVERY_SECONDS = 10.0
MARGIN_SECONDS = 15.0
"""How long before the lease would run out `check` already counts it lost."""
log = logging.getLogger("trnflow.lock")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """The run's logger inside a flow run (the thread copies its context), else this module's."""
    try:
        return get_run_logger()
    except Exception:
        return log


def team_model(spec: JobSpec, team: Team) -> str:
    """The model a run's lock is for: its name, within its team where teams are declared (two teams'
    models of one name are two models, in two registries)."""
    return spec.name if team.unrestricted else f"{team.name}.{spec.name}"


def limit_name(model: str) -> str:
    return f"trnflow-model-{model}"


def _holder_variable(model: str) -> str:
    """The Prefect variable naming the run that holds the model's slot (variable names are
    lowercase letters, digits, '_' and '-')."""
    return "trnflow-holder-" + re.sub(r"[^a-z0-9_-]", "_", model.lower())


def holder_label(run_id: str) -> str:
    """How a run that holds a model's slot is named to the runs that wait for it."""
    name = flow_run.get_name()
    return f"run {run_id}" + (f" (flow run {name!r})" if name else "")


def _holding(model: str) -> dict:
    """The record the holder of the model's slot left: who, and its process (host and pid); empty
    when no run holds it or the record cannot be read."""
    try:
        record = Variable.get(_holder_variable(model), default=None)
    except Exception:  # only a nicer message, and freeing a dead holder's slot, depend on it
        return {}
    return record if isinstance(record, dict) else {}


def holder(model: str) -> str | None:
    """Which run holds the model's slot, as it described itself; None if unknown."""
    return _holding(model).get("who")


def _announce(model: str, record: dict | None) -> None:
    """Record (or with None, clear) who holds the model's slot."""
    try:
        Variable.set(_holder_variable(model), record or {}, overwrite=True)
    except Exception as exc:
        _logger().warning("could not record the holder of %s (%s)", limit_name(model), exc)


def _free_if_dead(client, name: str, model: str) -> bool:
    """Free the slot when the run holding it was a process on this host that is gone (killed, out
    of memory) without giving it back: a server that keeps leases in memory, such as the local
    API `trnflow run` starts, forgets the lease when it stops, and the slot would stay taken."""
    record = _holding(model)
    pid = record.get("pid")
    if record.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid() or pid_alive(pid):
        return False
    _logger().warning("%s (pid %d on this host) ended without giving back %s; freeing it", record.get("who"), pid,
                      name)
    with contextlib.suppress(Exception):  # the lease may be gone with the server that had it
        client.release_concurrency_slots_with_lease(uuid.UUID(record["lease"]))
    limit = client.read_global_concurrency_limit_by_name(name)
    if limit.active_slots:
        client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=0))
    _announce(model, None)
    return True


def _freeing(name: str) -> str:
    return f"`prefect gcl update {name} --active-slots 0` frees a slot no run holds"


def ensure_limit(model: str) -> str:
    """Create the model's limit (one slot) if the server has none yet."""
    name = limit_name(model)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    return name


class ModelLock:
    """A held slot of the model's limit, renewed in a thread of its own until released."""

    def __init__(self, model: str, name: str, lease_id: uuid.UUID):
        self.model, self.name, self.lease_id = model, name, lease_id
        self.lost: str | None = None
        self._expires = time.monotonic() + LEASE_SECONDS
        self._stop = threading.Event()
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=lambda: context.run(self._renew), name=f"{name}-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        # a client of its own, with a short timeout: not the flow engine's, whose calls may wait minutes
        with get_client(sync_client=True, httpx_settings={"timeout": RENEW_EVERY_SECONDS}) as client:
            while not self._stop.wait(RENEW_EVERY_SECONDS) and self.lost is None:
                asked = time.monotonic()  # the lease runs from when the server renewed it, at the latest now
                try:
                    client.renew_concurrency_lease(self.lease_id, LEASE_SECONDS)
                    self._expires = asked + LEASE_SECONDS
                except Exception as exc:
                    status = getattr(getattr(exc, "response", None), "status_code", None)
                    if status in (404, 410):
                        self.lost = "the server no longer knows its lease (it expired, or the server restarted)"
                    elif time.monotonic() >= self._expires:
                        self.lost = f"the server did not answer for over {LEASE_SECONDS:g} s ({exc})"
                    else:
                        _logger().warning("could not renew the lease on %s (%s); trying again in %g s", self.name,
                                          exc, RENEW_EVERY_SECONDS)

    def check(self) -> None:
        """Raise FatalError when the lease was lost, or is about to run out unrenewed: another run of
        the model may hold the slot by the time this one acts."""
        if self.lost is None and time.monotonic() >= self._expires - MARGIN_SECONDS:
            self.lost = f"its lease was last renewed over {LEASE_SECONDS - MARGIN_SECONDS:g} s ago"
        if self.lost is not None:
            raise FatalError(f"this run lost its hold on {self.name}: {self.lost}. Another run of "
                             f"{self.model} may be running, so this run stops before promoting; the champion "
                             "is unchanged and the next run retries the same window")

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * RENEW_EVERY_SECONDS)
        if self.lost is None:
            try:
                with get_client(sync_client=True, httpx_settings={"timeout": RENEW_EVERY_SECONDS}) as client:
                    client.release_concurrency_slots_with_lease(self.lease_id)
            except Exception as exc:  # the lease runs out by itself
                _logger().warning("could not release %s (%s); it frees itself within %g s", self.name, exc,
                                  LEASE_SECONDS)


def _acquire(name: str, timeout_seconds: float | None, model: str) -> uuid.UUID:
    """A lease on the limit's one slot, waiting while another run holds it (TimeoutError past the
    timeout), in the state `Waiting` with the reason, and `Running` again once it holds it."""
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    told = False
    with get_client(sync_client=True) as client:
        while True:
            try:
                answer = client.increment_concurrency_slots_with_lease(
                    names=[name], slots=1, mode="concurrency", lease_duration=LEASE_SECONDS)
                if told:
                    running_as("Running", f"holds {name}", _logger())
                return uuid.UUID(answer.json()["lease_id"])
            except PrefectHTTPStatusError as exc:
                if exc.response.status_code != 423:  # 423 Locked: the slot is taken
                    raise
                pause = float(exc.response.headers.get("Retry-After", 1.0))
            if _free_if_dead(client, name, model):
                continue
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(name)
            if not told:
                why = f"{holder(model) or 'another run'} holds {name}; waiting for it to end"
                _logger().info("%s", why)
                running_as(WAITING, f"waiting: {why}", _logger())
                told = True
            time.sleep(max(0.1, min(pause, deadline - time.monotonic() if deadline is not None else pause)))


@contextlib.contextmanager
def model_lock(model: str, timeout_seconds: float | None, who: str = "a run") -> Iterator[ModelLock]:
    """Hold the model's slot as `who` (the run, described for others to read); wait up to
    `timeout_seconds` for it (None: as long as it takes)."""
    name = ensure_limit(model)
    try:
        lease_id = _acquire(name, timeout_seconds, model)
    except TimeoutError:
        holding = holder(model)
        raise FatalError(f"{holding or 'another run'} of {model} has held the concurrency limit {name} for over "
                         f"{timeout_seconds:g} s, so this run was refused; it is safe to run again once that run "
                         f"has ended. If no such run is going, {_freeing(name)}") from None
    _announce(model, {"who": who, "host": socket.gethostname(), "pid": os.getpid(), "lease": str(lease_id)})
    held = ModelLock(model, name, lease_id)
    try:
        yield held
    finally:
        _announce(model, None)
        held.release()
