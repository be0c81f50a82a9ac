"""The consoles every command prints to, and how an error line is printed: Rich alone, so that a
command group that prints no report (`trnflow cache`) starts without the report modules."""

from __future__ import annotations

import os
import re

from rich.console import Console
from rich.markup import escape

PIPED_WIDTH = 200
"""How wide printed output may be when it goes to a file or pipe rather than a terminal."""

RED = {"style": "red", "markup": False, "highlight": False}
"""`console.print(text, **RED)`: an error line in red, its text printed as it is (never as markup)."""


def cli_console(stderr: bool = False) -> Console:
    """The CLI's console. On a terminal it is as wide as the terminal; piped or redirected, Rich
    would cut tables at 80 columns, so it is PIPED_WIDTH wide unless COLUMNS says otherwise."""
    out = Console(stderr=stderr)
    if out.is_terminal or "COLUMNS" in os.environ:
        return out
    return Console(stderr=stderr, width=PIPED_WIDTH)


CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""Characters a terminal acts on (escape sequences, bells, carriage returns) rather than shows."""


def plain(value: object) -> str:
    """A value read from a file or a server, safe to print as it is: its control characters written
    out (`\\x1b`), so that none reaches the terminal."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def shown(value: object) -> str:
    """`plain`, and safe inside Rich markup too: its square brackets escaped, so `[link=...]` is text."""
    return escape(plain(value))
