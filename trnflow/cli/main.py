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
import traceback

import typer

from trnflow.errors import ChampionKept, ExitCode, GateFailed, TrnflowError

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
    args, prog = (sys.argv[2:], f"trnflow {group}") if group else (sys.argv[1:], "trnflow")
    sys.exit(outcome(lambda: app(args=args, prog_name=prog, standalone_mode=False)))


BUG = ("this is a bug in trnflow, not something you did: please report it to the trnflow project's issue "
       "tracker with the command you ran and the traceback above")

PATH_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
"""Expected failures that are a path's: exit 2, as a spec the loader refuses."""


def _loaded(module: str, *names: str) -> tuple[type, ...]:
    """Exception classes of `module` when it was imported (then they can have been raised), else none:
    so `trnflow cache` starts without the job specs, boto3 or httpx."""
    found = sys.modules.get(module)
    return tuple(getattr(found, name) for name in names) if found is not None else ()


def _input_error(exc: BaseException) -> bool:
    """A refused spec or a bad path."""
    return isinstance(exc, PATH_ERRORS + _loaded("trnflow.specs.loader", "SpecError"))


def _expected_failure(exc: BaseException) -> ExitCode | None:
    """The exit code of a failure that is not trnflow's fault: its own errors, the cloud's answers
    (no credentials, access denied, a bucket that is not there) and a network or server that does
    not answer. None for anything else: a bug."""
    if isinstance(exc, GateFailed):
        return ExitCode.GATE_FAILED
    if isinstance(exc, ChampionKept):
        return ExitCode.CHAMPION_KEPT
    if isinstance(exc, _loaded("trnflow.lifecycle.registry", "PromotionConflict")):
        return ExitCode.CONFLICT
    outside = (TrnflowError, ConnectionError, TimeoutError, *_loaded("botocore.exceptions", "BotoCoreError",
                                                                     "ClientError"),
               *_loaded("httpx", "HTTPError"))
    return ExitCode.FAILED if isinstance(exc, outside) else None


def outcome(command) -> int:
    """Run `command` (a Click main without its standalone handling) and turn how it ended into an
    exit code: an expected failure (a usage error, a refused spec or path, any trnflow error) is one
    message on stderr, never a traceback; anything else is a bug, shown with its traceback and a
    line asking for a report."""
    try:
        code = command()
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except typer.Abort:
        return ExitCode.INTERRUPTED
    except typer.TyperException as exc:  # a usage error: Click's own message and exit code (2)
        exc.show()
        return exc.exit_code
    except Exception as exc:
        code = ExitCode.BAD_INPUT if _input_error(exc) else _expected_failure(exc)
        if code is not None:
            _say(exc)
            return code
        traceback.print_exc()
        print(f"\ntrnflow: {BUG}", file=sys.stderr)
        return ExitCode.BUG
    return code if isinstance(code, int) else ExitCode.OK


def _say(exc: BaseException) -> None:
    text = str(exc) or type(exc).__name__
    prefix = "" if isinstance(exc, TrnflowError | ValueError) else f"{type(exc).__name__}: "
    print(f"trnflow: {prefix}{text}", file=sys.stderr)


if __name__ == "__main__":
    main()
