"""The consoles every command prints to, and how an error line is printed: Rich alone, so that a
command group that prints no report (`trnflow cache`) starts without the report modules."""

from __future__ import annotations

import os

from rich.console import Console
from rich.markup import escape

from trnflow.redact import printable

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


def plain(value: object) -> str:
    """A value read from a file or a server, safe to print on one line: `printable`, with its line
    breaks and tabs written out too (`\\x0a`), so that it cannot pass for other lines or columns."""
    return printable(str(value)).replace("\n", "\\x0a").replace("\t", "\\x09")


def shown(value: object) -> str:
    """`plain`, and safe inside Rich markup too: its square brackets escaped, so `[link=...]` is text."""
    return escape(plain(value))
