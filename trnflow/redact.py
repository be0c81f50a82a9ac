"""Secrets never reach a log: values of secret-looking environment variables (keys, tokens,
passwords) are masked in every line trnflow relays from a job, in every failure message and in every
artifact it publishes, in the forms a secret takes on its way there (as it is, URL-encoded as in a
presigned URL's token, JSON-escaped, base64 as in a Basic authorization header), along with the
password of any `scheme://user:password@host` URL and the password half of a `user:password`
auth string (PREFECT_API_AUTH_STRING).

What a job wrote reaches a terminal only through `printable`: a hostile or broken recipe's output
could otherwise set the reader's clipboard (OSC 52), plant links (OSC 8), move the cursor over
earlier lines, or reverse the text shown (U+202E)."""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterator, Mapping
from urllib.parse import quote, quote_plus, urlsplit

SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|AUTH_STRING|_KEY(_ID)?$|^KEY$",
                         re.IGNORECASE)
MASK = "********"
MIN_LENGTH = 6
"""Shorter values (`true`, `1`) would mask ordinary words."""
TERMINAL_SEQUENCE = re.compile(
    r"(?:\x1b\]|\x9d|\x1bP|\x90|\x1b[X^_]|\x98|\x9e|\x9f)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, DCS, SOS/PM/APC
    r"|(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"  # CSI: cursor moves, colours, ...
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?")  # any other escape
"""A terminal's control sequence, whole: its introducer, parameters and terminator."""
UNSHOWN = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")
"""Characters a terminal acts on or hides rather than shows: C0 and C1 controls (but tab and newline),
and the bidirectional and zero-width formatting marks that make text read other than it is."""
URL_PASSWORD = re.compile(r"(?P<keep>[a-z][a-z0-9+.-]*://[^\s:/@]*):(?P<password>[^\s/@]+)@", re.IGNORECASE)
"""The password of a URL written out in any text (a database URL in a driver's error, say)."""


def _parts(name: str, value: str) -> Iterator[str]:
    """The secrets one environment variable holds."""
    if SECRET_NAME.search(name):
        yield value
        user, colon, password = value.partition(":")
        if colon and user and "://" not in value:  # an auth string, user:password
            yield password
    for url in value.split():  # DATABASE_URL, PREFECT_API_DATABASE_CONNECTION_URL, any URL with a password
        if "://" in url and "@" in url:
            try:
                password = urlsplit(url).password
            except ValueError:
                continue
            if password:
                yield password


def _forms(secret: str) -> Iterator[str]:
    """A secret as it is and as it appears once encoded for a URL, a JSON string or a header."""
    yield secret
    yield quote(secret, safe="")
    yield quote_plus(secret, safe="")
    yield json.dumps(secret)[1:-1]
    yield base64.b64encode(secret.encode()).decode()


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The strings to mask, longest first (so a secret containing another is masked whole)."""
    environ = os.environ if environ is None else environ
    values = {form for name, value in environ.items() for part in _parts(name, value)
              if len(part) >= MIN_LENGTH for form in _forms(part)}
    return sorted(values, key=len, reverse=True)


class Redactor:
    def __init__(self, secrets: list[str]):
        self._pattern = re.compile("|".join(map(re.escape, secrets))) if secrets else None

    @classmethod
    def from_env(cls) -> Redactor:
        return cls(secret_values())

    def __call__(self, text: str) -> str:
        text = URL_PASSWORD.sub(lambda m: f"{m['keep']}:{MASK}@", text)
        return self._pattern.sub(MASK, text) if self._pattern else text


def printable(text: str) -> str:
    """`text` (a job's log line, a failure message) with every terminal control sequence removed and
    any other control or formatting character written out (`\\x07`, `\\u202e`): what it shows is
    what was written, and nothing in it acts on the terminal. Newlines and tabs stay."""
    text = TERMINAL_SEQUENCE.sub("", text)
    return UNSHOWN.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", text)


def without_credentials(url: str) -> str:
    """`s3://user:secret@bucket/x` -> `s3://***@bucket/x`: a URL safe to repeat in a message."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if sep and "@" in host:
        return f"{scheme}://***@{host.rpartition('@')[2]}{slash}{path}"
    return url
