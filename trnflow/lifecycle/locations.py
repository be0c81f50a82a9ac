"""Before a run trains: every location it will write is writable, and the registry it will judge
and register in can be read whole. A run that would fail on these after hours of training fails
in seconds instead, naming the location and what is wrong."""

from __future__ import annotations

import uuid

from trnflow.errors import FatalError
from trnflow.lifecycle.registry import Registry, RegistryCorrupt
from trnflow.redact import without_credentials
from trnflow.specs import JobSpec
from trnflow.storage import open_store


def _probe(url: str) -> str | None:
    """Write, read back and delete a small object at `url`: None when all three work, else why not."""
    name = f".trnflow-probe-{uuid.uuid4().hex[:12]}"
    try:
        store = open_store(url)
        store.write(name, b"probe")
        if store.read(name) != b"probe":
            return "an object written there reads back different"
        store.delete(name)
    except Exception as exc:  # any failure here is the answer: permissions, a missing bucket, a full disk
        return f"{type(exc).__name__}: {exc}"
    return None


def locations(spec: JobSpec) -> dict[str, str]:
    """The spec fields naming a location the run writes, and their URLs."""
    found = {"train.checkpoint_url": spec.train.checkpoint_url, "compile.cache_url": spec.compile.cache_url,
             "inference.output_url": spec.inference.output_url}
    if spec.registry_url:
        found["registry_url"] = spec.registry_url
    return found


def check_locations(spec: JobSpec) -> None:
    """FatalError naming each location that cannot be written, and a registry file that cannot be read."""
    problems = [f"{field} {without_credentials(url)}: cannot be written ({why}); make it writable for "
                "this run, or point the field elsewhere"
                for field, url in locations(spec).items() if (why := _probe(url)) is not None]
    if spec.registry_url:
        try:
            Registry(spec.registry_url).check(spec.name)
        except RegistryCorrupt as exc:
            problems.append(f"registry_url: {exc}")
    if problems:
        raise FatalError("before training: " + "; ".join(problems))
