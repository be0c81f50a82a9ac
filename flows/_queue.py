"""The stack's queue on the Prefect server (`trnflow.backends.stack_queue`'s `StackStore`): entries,
yield requests and each day's spend per team as Variables, the queue's lock and the capacity each team and type holds as
global concurrency limits, whose leased slots a dead orchestrator's server frees by itself."""

from __future__ import annotations

import contextlib
import hashlib
import re
import time
from collections.abc import Callable, Iterator

from httpx import HTTPStatusError
from prefect.client.orchestration import SyncPrefectClient, get_client
from prefect.client.schemas.actions import (
    GlobalConcurrencyLimitCreate,
    GlobalConcurrencyLimitUpdate,
    VariableCreate,
    VariableUpdate,
)
from prefect.client.schemas.objects import Variable
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.settings import PREFECT_API_URL
from pydantic import ValidationError

from trnflow.backends.runqueue import QueueEntry, Spend, YieldRequest
from trnflow.backends.stack_queue import LEASE_SECONDS, STALE_SECONDS
from trnflow.errors import TransientError

LOCK = "trnflow-queue"
"""The global concurrency limit of one slot that one decision at a time holds."""
ENTRY = "trnflow-queue-"
REQUEST = "trnflow-yield-"
SPEND = "trnflow-spend-"
TAG = "trnflow-queue"
"""The tag of the queue's variables (the UI's Variables page filters on it)."""
TAKE_SECONDS = 5.0
"""How long taking a run's slots may wait: the decision has just found them free."""


LOCK_SECONDS = 300.0
"""How long a decision waits for the queue's lock before it says what holds it up."""
PAGE = 200
"""Variables read per request (the server's most)."""


def variable_name(prefix: str, run_id: str) -> str:
    """A run's variable: Prefect's names are lowercase letters, digits, `-` and `_`, so the run id,
    so written, ends with a digest of it as it is (`Run.1` and `run_1` are two runs)."""
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{prefix}{re.sub(r'[^a-z0-9_-]', '_', run_id.lower())[:120]}-{digest}"


def _named(client: SyncPrefectClient, prefix: str) -> list[Variable]:
    """Every variable whose name starts with `prefix`, page by page."""
    found: list[Variable] = []
    while True:
        response = client.request("POST", "/variables/filter", json={
            "variables": {"name": {"like_": f"{prefix}%"}}, "offset": len(found), "limit": PAGE})
        page = [Variable.model_validate(v) for v in response.json()]
        found += [v for v in page if v.name.startswith(prefix)]
        if len(page) < PAGE:
            return found


def _client() -> SyncPrefectClient:
    return get_client(sync_client=True)


def _put(client: SyncPrefectClient, name: str, value: dict) -> None:
    try:
        client.update_variable(VariableUpdate(name=name, value=value, tags=[TAG]))
    except HTTPStatusError as exc:
        if exc.response.status_code != 404:
            raise
        client.create_variable(VariableCreate(name=name, value=value, tags=[TAG]))


def _forget(client: SyncPrefectClient, name: str) -> None:
    with contextlib.suppress(ObjectNotFound):
        client.delete_variable_by_name(name)


class PrefectQueue:
    """The stack's queue kept on the Prefect server this process talks to (PREFECT_API_URL)."""

    def __init__(self) -> None:
        self._locks: set[str] = set()
        """The servers (API URLs) whose lock this process has made sure of: once each, not per decision."""

    @contextlib.contextmanager
    def deciding(self) -> Iterator[None]:
        server = str(PREFECT_API_URL.value())
        if server not in self._locks:
            self.ensure_limit(LOCK, 1)
            self._locks.add(server)
        try:
            held = concurrency(LOCK, occupy=1, timeout_seconds=LOCK_SECONDS, lease_duration=LEASE_SECONDS,
                               strict=True, raise_on_lease_renewal_failure=False)
            held.__enter__()
        except TimeoutError:
            raise TransientError(f"the stack's queue's lock (global concurrency limit {LOCK} on the Prefect server) "
                                 f"was not free for {LOCK_SECONDS:.0f} s: a decider's lease the server lost (its "
                                 "leases are in its memory unless PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE says "
                                 "otherwise) holds it; reset the limit's slots in the UI's Concurrency page") from None
        try:
            yield
        finally:
            held.__exit__(None, None, None)

    def entries(self) -> list[QueueEntry]:
        found, now = [], time.time()
        with _client() as client:
            for variable in _named(client, ENTRY):
                try:
                    entry = QueueEntry.model_validate(variable.value)
                except ValidationError:
                    continue  # written by another version of trnflow: not ours to judge
                if entry.beat is None or now - entry.beat > STALE_SECONDS:  # its process is gone
                    _forget(client, variable.name)
                    _forget(client, variable_name(REQUEST, entry.run_id))
                    continue
                found.append(entry)
        return found

    def put(self, entry: QueueEntry) -> None:
        own = {entry.team: entry.shares[entry.team]} if entry.team in entry.shares else {}
        value = entry.model_copy(update={"shares": own})  # every decider reads the others' from its teams file
        with _client() as client:
            _put(client, variable_name(ENTRY, entry.run_id), value.model_dump(mode="json"))

    def forget(self, run_id: str) -> None:
        with _client() as client:
            _forget(client, variable_name(ENTRY, run_id))

    def request(self, run_id: str) -> YieldRequest | None:
        with _client() as client:
            variable = client.read_variable_by_name(variable_name(REQUEST, run_id))
        if variable is None:
            return None
        try:
            return YieldRequest.model_validate(variable.value)
        except ValidationError:
            return None

    def ask(self, run_id: str, request: YieldRequest) -> None:
        with _client() as client:
            _put(client, variable_name(REQUEST, run_id), request.model_dump(mode="json"))

    def drop_request(self, run_id: str) -> None:
        with _client() as client:
            _forget(client, variable_name(REQUEST, run_id))

    def spent(self, day: str) -> dict[str, float]:
        with _client() as client:
            variable = client.read_variable_by_name(SPEND + day)
        try:
            return Spend.model_validate(variable.value).teams if variable is not None else {}
        except ValidationError:
            return {}

    def add_spend(self, team: str, day: str, usd: float) -> None:
        teams = self.spent(day)
        teams[team] = teams.get(team, 0.0) + usd
        with _client() as client:
            _put(client, SPEND + day, Spend(teams=teams).model_dump(mode="json"))
            for old in _named(client, SPEND):  # earlier days count no more
                if old.name != SPEND + day:
                    _forget(client, old.name)

    def ensure_limit(self, name: str, limit: int) -> None:
        with _client() as client:
            try:
                found = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                with contextlib.suppress(ObjectAlreadyExists):  # another orchestrator made it first
                    client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
                return
            if found.limit != limit or not found.active:  # an inactive limit would hold nothing
                client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=limit, active=True))

    def hold(self, names: list[str], slots: int) -> Callable[[], None] | None:
        held = contextlib.ExitStack()
        try:
            held.enter_context(concurrency(names, occupy=slots, timeout_seconds=TAKE_SECONDS,
                                           lease_duration=LEASE_SECONDS, strict=True,
                                           raise_on_lease_renewal_failure=False))
        except TimeoutError:
            return None
        return held.close

    def limits(self) -> dict[str, tuple[int, int]]:
        """The queue's limits as the server holds them: name: (slots taken, limit)."""
        with _client() as client:
            found = client.read_global_concurrency_limits(limit=200)
        return {g.name: (g.active_slots, g.limit) for g in found if g.name.startswith("trnflow-")}


PREFECT_QUEUE = PrefectQueue()
