"""One retraining run per model at a time, whatever started it (a schedule, the UI, the CLI): a
Prefect global concurrency limit of one slot per model, held for the whole run.

The slot is a lease the run renews while it lives, so a run whose process dies gives it back when
the server's lease service sees the lease run out (`LEASE_SECONDS`), instead of blocking every later
run. A lease the server lost (in-memory leases and a restart) leaves the slot taken:
`prefect gcl update trnflow-retrain-<model> --active-slots 0` frees it. A renewal that fails (the
server restarting) does not stop the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from trnflow.errors import FatalError

LEASE_SECONDS = 60.0


def limit_name(model: str) -> str:
    return f"trnflow-retrain-{model}"


def ensure_limit(model: str) -> str:
    """Create the model's limit (one slot) if the server has none yet."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = limit_name(model)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

            with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
    return name


@contextlib.contextmanager
def model_lock(model: str, timeout_seconds: float | None) -> Iterator[None]:
    """Hold the model's slot; wait up to `timeout_seconds` for it (None: as long as it takes)."""
    from prefect.concurrency.sync import concurrency

    name = ensure_limit(model)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(concurrency(name, occupy=1, timeout_seconds=timeout_seconds,
                                           lease_duration=LEASE_SECONDS, strict=True,
                                           raise_on_lease_renewal_failure=False))
        except TimeoutError:
            raise FatalError(f"another retraining run of {model} has held the concurrency limit {name} for over "
                             f"{timeout_seconds:g} s, so this run was refused; it is safe to run again later "
                             f"(`prefect gcl inspect {name}` shows the limit)") from None
        yield
