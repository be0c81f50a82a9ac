"""The `trnflow` command's entry point.

A command group that stands on its own is started without the rest of the app: `trnflow cache`
imports its group, the cache and Rich, not the job specs, backends and reports every other command
needs (about 0.3 s of a start-up, which matters to a listing of thousands of entries). Everything
else, `trnflow --help` included, goes to the whole app (`trnflow.cli.app`).
"""

from __future__ import annotations

import importlib
import os
import sys

STANDALONE = {"cache": ("trnflow.cli.cache", "cache_app")}
"""Command groups started on their own: name -> (module, its Typer app). A group belongs here when
its module imports none of the app's other modules."""
WHOLE = ("trnflow.cli.app", "app")
"""Every other command, and `trnflow --help`."""


def main() -> None:
    # Prefect reads its settings once, when it is first imported (a command imports its flows before
    # running them), so these defaults are set before anything else. Its local API starts in a process
    # of its own, and the 20 s default start timeout is short on a busy laptop.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    group = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] in STANDALONE else None
    module, name = STANDALONE[group] if group else WHOLE
    app = getattr(importlib.import_module(module), name)
    try:
        if group:
            app(args=sys.argv[2:], prog_name=f"trnflow {group}")
        else:
            app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
