"""Fault injection: reproducible failures of chosen emulated cores.

Faults come from the spec's `faults` list and from `TRNFLOW_FAULTS`, a comma-separated list of
`kind@core` (for example `corrupt@1,hang@3`). The launcher hands the merged list to every worker;
a worker applies the faults of the core it owns.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import torch

from trnflow.errors import FatalError

FAULTS_ENV = "TRNFLOW_FAULTS"
KINDS = ("corrupt", "hang", "memory")


@dataclass(frozen=True)
class Fault:
    kind: str
    core: int


def parse(text: str) -> list[Fault]:
    """`corrupt@1,hang@3` (or the JSON list the launcher writes) -> faults."""
    text = text.strip()
    if not text:
        return []
    if text.startswith("["):
        return [Fault(f["kind"], int(f["core"])) for f in json.loads(text)]
    faults = []
    for item in text.split(","):
        kind, sep, core = item.strip().partition("@")
        if not sep or kind not in KINDS or not core.isdigit():
            raise FatalError(f"{FAULTS_ENV}: {item!r} is not kind@core with kind one of {', '.join(KINDS)}")
        faults.append(Fault(kind, int(core)))
    return faults


def encode(faults: list[Fault]) -> str:
    return json.dumps([{"kind": f.kind, "core": f.core} for f in faults])


class CoreFaults:
    """The faults that hit one core, as the workload sees them."""

    def __init__(self, core: int, faults: list[Fault] | None = None):
        if faults is None:
            faults = parse(os.environ.get(FAULTS_ENV, ""))
        self.kinds = {f.kind for f in faults if f.core == core}

    def corrupt(self, t: torch.Tensor) -> torch.Tensor:
        """A wrong answer from this core's engines: a few elements off by a visible margin."""
        if "corrupt" not in self.kinds or t.numel() == 0:
            return t
        out = t.clone()
        flat = out.view(-1)
        flat[:: max(1, flat.numel() // 7)] += 0.5 + flat[:: max(1, flat.numel() // 7)].abs()
        return out

    def flip_bits(self, buf: torch.Tensor) -> None:
        """Stuck bits in this core's memory: one word in every 4096 loses its lowest bit."""
        if "memory" in self.kinds:
            buf.view(-1)[::4096].bitwise_xor_(1)

    def maybe_hang(self) -> None:
        """Stall forever, as a core hung in a collective does; the peers' timeout cuts it off."""
        if "hang" in self.kinds:
            while True:
                time.sleep(3600)
