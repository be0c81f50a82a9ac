"""A compile cache entry's lock, `<entry>/model.lock`: which process compiles the entry, so that
no other compiles it at once. A lock whose process is gone (on this host), that is a day old, or
that is garbled, is stale and taken over. It is trnflow's own: neuronx-cc's locks are named after
the HLO module they compile."""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable

from trnflow.device.cache_entry import read_json, short
from trnflow.errors import FatalError
from trnflow.processes import pid_alive
from trnflow.storage import Store

STALE_LOCK_SECONDS = 24 * 3600.0
"""A lock held this long is taken for abandoned: no compile takes a day, and a pid on this host may
have been given to another process (pid 1 never ends) since the lock was taken."""
LOCK_CLOCK_SKEW_SECONDS = 300.0
"""How far in the future a lock's start time may be (another host's clock running ahead): a lock
taken later than that, or at an infinite time, would never go stale, so it is read as garbled."""


class EntryLocked(Exception):
    def __init__(self, entry: str, owner: dict):
        super().__init__(f"{entry} is being compiled by pid {owner.get('pid')} on {owner.get('host')}")
        self.owner = owner


def lock_owner(store: Store, entry: str, where: Callable[[str], str]) -> dict | None:
    """The live process compiling `entry`, or None. A lock whose process is gone is stale.

    Raises FatalError (naming the file as `where` writes it) for a lock record whose pid or start
    time is not a number."""
    owner = read_json(store, f"{entry}/model.lock")
    if owner is None:
        return None
    try:
        pid, since = int(owner.get("pid", -1)), float(owner.get("since", 0))
        if not math.isfinite(since) or since > time.time() + LOCK_CLOCK_SKEW_SECONDS:
            raise ValueError("a start time no compile can have")  # it would never go stale
    except (TypeError, ValueError, OverflowError):
        raise FatalError(f"{where(f'{entry}/model.lock')}: a garbled lock record (pid "
                         f"{short(owner.get('pid'))}, since {short(owner.get('since'))}); trnflow did not "
                         "write it this way and no compile holds it: remove that file") from None
    if not time.time() - since < STALE_LOCK_SECONDS:  # older than any compile: abandoned, whoever holds the pid
        return None
    if owner.get("host") == socket.gethostname():
        return owner if pid_alive(pid) else None
    return owner


def acquire(store: Store, entry: str, token: str, where: Callable[[str], str]) -> bool:
    """Take the entry's lock for the holder `token`. Returns True when a stale lock (dead holder)
    had to be cleared. Raises EntryLocked when a live process holds it."""
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                         "token": token}).encode()
    cleared = False
    for _ in range(3):
        if store.create(f"{entry}/model.lock", record):
            return cleared
        try:
            owner = lock_owner(store, entry, where)
        except FatalError:  # garbled: no live compile holds it
            owner = None
        if owner is not None:
            raise EntryLocked(entry, owner)
        store.delete(f"{entry}/model.lock")  # stale: its process is gone (or it is garbled)
        cleared = True
    raise EntryLocked(entry, {"pid": "?", "host": "?"})


def release(store: Store, entry: str, token: str) -> None:
    """Give the entry's lock back, when `token` still holds it."""
    owner = read_json(store, f"{entry}/model.lock")
    if owner is not None and owner.get("token") == token:
        store.delete(f"{entry}/model.lock")
