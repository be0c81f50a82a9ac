"""Where this host keeps the state of its NeuronCores' users: one directory per user and machine.

The emulator's core locks live there (one process per core, as the Neuron runtime enforces), and so
does the machine's queue of runs (`trnflow.backends.machine`): whoever shares the cores shares the
queue. `TRNFLOW_NEURON_RT_DIR` moves it (a test's own machine, a mock cloud host's).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

RT_DIR_ENV = "TRNFLOW_NEURON_RT_DIR"


def runtime_dir() -> Path:
    """This host's directory for its cores' users, created when missing."""
    configured = os.environ.get(RT_DIR_ENV)
    path = Path(configured) if configured else Path(tempfile.gettempdir()) / f"trnflow-neuron-rt-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path
