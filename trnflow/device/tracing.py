"""What TorchDynamo loads before it traces a process's first program, loaded ahead.

A process whose children trace programs (a launcher that forks its ranks, the local fork server
that forks launchers) imports these once, so that each rank finds them loaded instead of paying
for them itself: `torch.compile` with a backend of trnflow's imports TorchDynamo's debugging
wrappers at its first call, about 0.4 CPU-s in every rank of every compiling job. TorchDynamo
also names the function of every line it traces by tokenizing the line's source file, once per
process: `torch.nn.functional`'s takes a tenth of a second.
"""

from __future__ import annotations

import importlib

SOURCES_NAMED = ("torch.nn.functional", "torch.nn.modules.transformer")
"""The largest of the source files TorchDynamo reads while tracing a model built of torch.nn's layers."""
TRACING_MODULES = (
    "torch._dynamo",
    "torch._dynamo.repro.after_dynamo",  # imported by torch.compile's first call with a backend callable
)


def preload_tracing() -> None:
    """Import what tracing a program needs, into this process and so into every process forked from it."""
    for name in TRACING_MODULES:
        importlib.import_module(name)
    _name_sources()


def _name_sources() -> None:
    """Fill TorchDynamo's per-process table of function names for the largest sources it traces
    (`torch._dynamo.funcname_cache`; nothing, where a release has no such table)."""
    try:
        from torch._dynamo.funcname_cache import get_funcname  # torch: loaded by the caller already
    except ImportError:
        return
    for name in SOURCES_NAMED:
        get_funcname(importlib.import_module(name).__file__, 1)
