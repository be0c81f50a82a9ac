"""The end of a forked child that stands in for a new program (a job's supervisor forking its
launcher, a container forking its launcher, the mock cloud forking a container): it exits as
`python -m` would have, and never returns into the code it was forked from."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn


def run_as_program(body: Callable[[], object]) -> NoReturn:
    """Run `body` in this forked child, then exit as a program would: 0; a `SystemExit`'s code (1,
    its message printed, when the code is not a number); or 1 after printing the traceback. Its
    output is flushed first, since `os._exit` does not."""
    code = 1
    try:
        body()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # a closed stream has nothing left to write
                stream.flush()
        os._exit(code)
