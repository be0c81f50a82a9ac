"""The model registry: versioned model entries and an atomically promoted champion, on any store.

Layout under `registry_url` (a folder or an S3 prefix), per model (the spec's `name`):

    <model>/versions/v000003.json    one entry per registered model version (never rewritten)
    <model>/champion/g000007.json    one record per change of champion: promote or rollback

Both are written with `Store.create`, which fails when the object exists (a conditional put on
S3), so numbers are never reused. The champion is the version named by the newest generation
record. A promotion reads the newest generation g and creates g+1: two promotions racing from the
same g cannot both create it, and the loser is told who won. Nothing is ever overwritten, so the
history of champions is the list of generation records.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from trnflow.errors import FatalError, TrnflowError
from trnflow.storage import Store, open_store

_VERSION = re.compile(r"versions/v(\d{6})\.json$")
_GENERATION = re.compile(r"champion/g(\d{6})\.json$")


class PromotionConflict(TrnflowError):
    """Another promotion changed the champion first."""


class RegistryCorrupt(FatalError):
    """A registry file that cannot be read: named, with what to do."""

    def __init__(self, url: str, problem: str):
        super().__init__(f"{url}: corrupt registry file ({problem}). Restore it from a backup or from the "
                         "storage's object versions; if it cannot be restored and it is a version nobody uses, "
                         "move it out of the registry. The other versions are intact (`trnflow models ls`)")
        self.url = url


@dataclass(frozen=True)
class ModelVersion:
    model: str
    version: int
    entry: dict[str, Any]

    @property
    def checkpoint(self) -> str:
        return self.entry["checkpoint"]

    @property
    def watermark(self) -> str | None:
        return self.entry.get("watermark")


class Registry:
    def __init__(self, url: str, store: Store | None = None):
        self.url = url.rstrip("/")
        self.store = store or open_store(self.url)

    def _numbers(self, model: str, pattern: re.Pattern, folder: str) -> list[int]:
        found = []
        for obj in self.store.list(f"{model}/{folder}/"):
            match = pattern.search(obj.name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def _read(self, name: str) -> dict:
        model = name.split("/", 1)[0]
        try:
            record = json.loads(self.store.read(name))
        except FileNotFoundError:
            raise FatalError(f"{self.url}/{name}: not in the registry; `trnflow models ls {model} -r {self.url}` "
                             "lists the versions it has") from None
        except (ValueError, UnicodeDecodeError) as exc:
            raise RegistryCorrupt(f"{self.url}/{name}", str(exc)) from None
        if not isinstance(record, dict) or not isinstance(record.get("version"), int):
            raise RegistryCorrupt(f"{self.url}/{name}", "not a registry record (no integer 'version')")
        return record

    def models(self) -> list[str]:
        return sorted({o.name.split("/", 1)[0] for o in self.store.list() if "/versions/" in o.name})

    def versions(self, model: str) -> list[ModelVersion]:
        """Every version, oldest first; a version file that cannot be read is a RegistryCorrupt
        naming it (`readable` lists the others)."""
        return [self.version(model, v) for v in self._numbers(model, _VERSION, "versions")]

    def readable(self, model: str) -> tuple[list[ModelVersion], list[RegistryCorrupt]]:
        """The versions that can be read, and what is wrong with each one that cannot."""
        good, bad = [], []
        for number in self._numbers(model, _VERSION, "versions"):
            try:
                good.append(self.version(model, number))
            except RegistryCorrupt as exc:
                bad.append(exc)
        return good, bad

    def check(self, model: str) -> None:
        """Read every record of `model` (versions and changes of champion): a corrupt one is a
        RegistryCorrupt naming its file, found before a run spends time training."""
        self.versions(model)
        self.history(model)

    def version(self, model: str, version: int) -> ModelVersion:
        return ModelVersion(model, version, self._read(f"{model}/versions/v{version:06d}.json"))

    def register(self, model: str, entry: dict[str, Any]) -> ModelVersion:
        """Add a new version (the next free number, even when several runs register at once)."""
        number = (self._numbers(model, _VERSION, "versions") or [0])[-1] + 1
        while True:
            record = {**entry, "model": model, "version": number, "registered_at": round(time.time(), 3)}
            if self.store.create(f"{model}/versions/v{number:06d}.json", json.dumps(record, indent=2).encode()):
                return ModelVersion(model, number, record)
            number += 1

    def history(self, model: str) -> list[dict]:
        """Every change of champion, oldest first."""
        return [self._read(f"{model}/champion/g{g:06d}.json") for g in self._numbers(model, _GENERATION, "champion")]

    def _champion_at(self, model: str, generation: int) -> int | None:
        """The champion's version as of `generation` (None before the first promotion)."""
        return self._read(f"{model}/champion/g{generation:06d}.json")["version"] if generation else None

    def champion(self, model: str) -> ModelVersion | None:
        version = self._champion_at(model, self.generation(model))
        return None if version is None else self.version(model, version)

    def _set_champion(self, model: str, version: int, action: str, expected: int | None, reason: str) -> dict:
        self.version(model, version)  # it must exist
        current = self.generation(model)
        if expected is not None and current != expected:
            raise PromotionConflict(self._conflict(model, version))
        # the champion this change replaces is the one at `current`, whatever happens meanwhile
        record = {"generation": current + 1, "version": version, "action": action, "reason": reason,
                  "previous": self._champion_at(model, current), "at": round(time.time(), 3)}
        if not self.store.create(f"{model}/champion/g{current + 1:06d}.json", json.dumps(record, indent=2).encode()):
            raise PromotionConflict(self._conflict(model, version))
        return record

    def _conflict(self, model: str, version: int) -> str:
        now = self.champion(model)
        who = f"v{now.version}" if now else "none"
        return (f"{model}: promoting v{version} lost a race: the champion changed meanwhile and is now {who}. "
                "Look at `trnflow models ls` and promote again if it should still win")

    def generation(self, model: str) -> int:
        generations = self._numbers(model, _GENERATION, "champion")
        return generations[-1] if generations else 0

    def promote(self, model: str, version: int, reason: str = "", expected_generation: int | None = None) -> dict:
        """Make `version` the champion. With `expected_generation` (what the caller saw when it
        decided), a champion that changed since is a PromotionConflict rather than overwritten."""
        return self._set_champion(model, version, "promote", expected_generation, reason)

    def rollback_target(self, model: str) -> int:
        """The version a rollback would make champion: the one before the current champion
        (repeatable: each rollback goes one promotion further back)."""
        stack: list[int] = []
        for record in self.history(model):
            if record["action"] == "rollback":
                stack.pop()
            else:
                stack.append(record["version"])
        if len(stack) < 2:
            raise FatalError(f"{model}: there is no earlier champion to roll back to")
        return stack[-2]

    def rollback(self, model: str, reason: str = "", expected_generation: int | None = None) -> dict:
        """Make the champion before the current one the champion again."""
        generation = self.generation(model) if expected_generation is None else expected_generation
        return self._set_champion(model, self.rollback_target(model), "rollback", generation, reason)
