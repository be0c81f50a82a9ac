"""Locations as job specs and commands accept them, normalised to one absolute URL."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote, unquote


def normalise_url(value: str) -> str:
    """Accept `s3://bucket/key`, `file:///abs`, `file://rel` or a plain path; return an absolute URL.

    Relative paths are resolved against the current directory when the spec is loaded, so a spec
    handed to worker processes always carries absolute locations.
    """
    value = value.strip()
    if not value:
        raise ValueError("must not be empty; give a file:// or s3:// URL or a path")
    scheme, sep, rest = value.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:  # user:password@host: never repeat it, not even in an error
        raise ValueError(f"credentials in a {scheme}:// URL; remove them (user:secret@) and give AWS "
                         "credentials through AWS_PROFILE, the AWS_* variables or the instance's role")
    if not sep:
        return Path(value).expanduser().resolve().as_uri()
    if scheme == "file":  # a URL's %-escapes are the path's characters (as_uri escapes them again)
        return Path(unquote(rest)).expanduser().resolve().as_uri()
    if scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
            raise ValueError(f"{value!r} has no valid bucket name; write s3://<bucket>/<prefix>")
        return value
    raise ValueError(f"unsupported URL scheme {scheme!r} in {value!r}; use file:// or s3:// (or a plain path)")


S3_CONSOLE = "https://s3.console.aws.amazon.com/s3"


def shown(url: str) -> tuple[str, str | None]:
    """How a location is shown to a person in a browser: its text, and a link that opens it there,
    or None where a browser cannot open it. A local file is its plain path (a `file://` link on a
    web page opens nothing); an `s3://` location links to the S3 console, a folder or an object."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme == "file":
        return unquote(rest) if sep else url, None
    if scheme == "s3":
        bucket, _, key = rest.partition("/")
        if not key or key.endswith("/") or "." not in key.rsplit("/", 1)[-1]:  # a prefix: the folder's page
            prefix = f"{key.rstrip('/')}/" if key else ""
            return url, f"{S3_CONSOLE}/buckets/{bucket}?prefix={quote(prefix)}"
        return url, f"{S3_CONSOLE}/object/{bucket}?prefix={quote(key)}"
    return url, None
