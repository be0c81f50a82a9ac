"""Secrets never reach a log: values of secret-looking environment variables (keys, tokens,
passwords) are masked in every line trnflow relays from a job."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|PRIVATE|AUTH_STRING|_KEY(_ID)?$|^KEY$",
                         re.IGNORECASE)
MASK = "********"
MIN_LENGTH = 6
"""Shorter values (`true`, `1`) would mask ordinary words."""


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values to mask, longest first (so a secret containing another is masked whole)."""
    environ = os.environ if environ is None else environ
    values = {v for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= MIN_LENGTH}
    return sorted(values, key=len, reverse=True)


class Redactor:
    def __init__(self, secrets: list[str]):
        self._pattern = re.compile("|".join(map(re.escape, secrets))) if secrets else None

    @classmethod
    def from_env(cls) -> Redactor:
        return cls(secret_values())

    def __call__(self, text: str) -> str:
        return self._pattern.sub(MASK, text) if self._pattern else text


def without_credentials(url: str) -> str:
    """`s3://user:secret@bucket/x` -> `s3://***@bucket/x`: a URL safe to repeat in a message."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if sep and "@" in host:
        return f"{scheme}://***@{host.rpartition('@')[2]}{slash}{path}"
    return url
