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

import re
import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, StrictFloat, StrictInt

from trnflow.errors import FatalError, TrnflowError
from trnflow.records import PairedCheck, RecipeRef, Record, RecordError, dump, read
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


class VerdictSummary(Record):
    """The gate's verdict as a version's entry keeps it."""

    passed: bool
    mode: str
    metric: str | None = Field(None, description="the metric judged (None in versions registered before it was "
                               "recorded: accuracy)")
    reason: str | None = None
    paired: PairedCheck | None = None


class Digests(Record):
    """What a version's files were when it was registered, each a `manifest_digest` of a marker
    whose every file the registering process read and checked: the files are the same later only
    if the marker still lists exactly these (`trnflow.lifecycle.digests`)."""

    checkpoint: str = Field(description="the checkpoint's COMMITTED manifest")
    export: str | None = Field(None, description="the export's EXPORTED manifest, when it has one")


class RegistryEntry(Record):
    """One registered model version (`versions/vNNNNNN.json`). Only `checkpoint` is required: a
    model registered by hand has nothing else to say."""

    checkpoint: str = Field(description="the model's checkpoint")
    model: str | None = Field(None, description="the model's name (the spec's `name`); set on registration")
    version: int | None = Field(None, description="its version number; set on registration")
    registered_at: float | None = Field(None, description="when (Unix seconds); set on registration")
    run_id: str | None = Field(None, description="the run that trained it")
    status: Literal["passed", "rejected", "worse-than-champion"] | None = Field(
        None, description="the gate's decision: passed, rejected, or passed but worse than the champion")
    metrics: dict[str, StrictInt | StrictFloat | None] = Field(default_factory=dict,
                                                               description="its last evaluation point")
    series: str | None = Field(None, description="its metric series (metrics.json)")
    watermark: str | None = Field(None, description="the newest day partition it has seen")
    global_step: int | None = None
    parent: str | None = Field(None, description="the checkpoint it was trained further from")
    parent_version: int | None = Field(None, description="that checkpoint's version, when registered")
    recipe: RecipeRef | None = Field(None, description="its recipe: name, version and params")
    export: str | None = Field(None, description="the model in its own library's format")
    base: str | None = Field(None, description="LoRA: the content digest of the pretrained folder its adapters were "
                             "trained on and need (the folder its recipe's params name as pretrained)")
    weights: str | None = Field(None, description="the whole weights as a plain PyTorch state_dict (the checkpoint's "
                                "model.pt; for a sharded checkpoint, the one joined from its shards)")
    inputs: str | None = Field(None, description="the digest of what it was trained from: a rerun finds it")
    output_url: str | None = Field(None, description="where its inference outputs are published")
    spec_digest: str | None = None
    verdict: VerdictSummary | None = None
    tracking: str | None = Field(None, description="the MLflow server its run is mirrored to (tracking.mlflow_uri): "
                                 "a change of champion moves the `champion` alias there")
    forced: str | None = Field(None, description="why it was promoted although worse than the champion")
    digests: Digests | None = Field(None, description="its files as registered; a version without them (one "
                                    "registered by hand) cannot be promoted, served or trained from")


class ChampionChange(Record):
    """One change of champion (`champion/gNNNNNN.json`)."""

    generation: int = Field(ge=1)
    version: int = Field(ge=1, description="the champion from this generation on")
    action: Literal["promote", "rollback"]
    reason: str = ""
    previous: int | None = Field(None, description="the champion it replaced")
    at: float = Field(description="when (Unix seconds)")


@dataclass(frozen=True)
class ModelVersion:
    model: str
    version: int
    entry: RegistryEntry

    @property
    def checkpoint(self) -> str:
        return self.entry.checkpoint

    @property
    def watermark(self) -> str | None:
        return self.entry.watermark


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

    def _read(self, name: str, kind: type[RegistryEntry] | type[ChampionChange]) -> Any:
        model = name.split("/", 1)[0]
        try:
            data = self.store.read(name)
        except FileNotFoundError:
            raise FatalError(f"{self.url}/{name}: not in the registry; `trnflow models ls {model} -r {self.url}` "
                             "lists the versions it has") from None
        try:
            record = read(kind, data, f"{self.url}/{name}")
        except RecordError as exc:
            raise RegistryCorrupt(exc.origin, exc.problem) from None
        if isinstance(record, RegistryEntry) and record.version is None:
            raise RegistryCorrupt(f"{self.url}/{name}", "version: missing")
        return record

    def numbers(self, model: str) -> list[int]:
        """The model's version numbers, oldest first."""
        return self._numbers(model, _VERSION, "versions")

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
        return ModelVersion(model, version, self._read(f"{model}/versions/v{version:06d}.json", RegistryEntry))

    def register(self, model: str, entry: RegistryEntry | dict[str, Any]) -> ModelVersion:
        """Add a new version (the next free number, even when several runs register at once)."""
        if isinstance(entry, dict):
            entry = RegistryEntry.model_validate(entry)
        number = (self._numbers(model, _VERSION, "versions") or [0])[-1] + 1
        while True:
            record = entry.model_copy(update={"model": model, "version": number,
                                              "registered_at": round(time.time(), 3)})
            if self.store.create(f"{model}/versions/v{number:06d}.json", dump(record)):
                return ModelVersion(model, number, record)
            number += 1

    def history(self, model: str) -> list[ChampionChange]:
        """Every change of champion, oldest first."""
        return [self._read(f"{model}/champion/g{g:06d}.json", ChampionChange)
                for g in self._numbers(model, _GENERATION, "champion")]

    def _champion_at(self, model: str, generation: int) -> int | None:
        """The champion's version as of `generation` (None before the first promotion)."""
        return self._read(f"{model}/champion/g{generation:06d}.json", ChampionChange).version if generation else None

    def champion(self, model: str) -> ModelVersion | None:
        version = self._champion_at(model, self.generation(model))
        return None if version is None else self.version(model, version)

    def _set_champion(self, model: str, version: int, action: Literal["promote", "rollback"], expected: int | None,
                      reason: str) -> ChampionChange:
        self.version(model, version)  # it must exist
        current = self.generation(model)
        if expected is not None and current != expected:
            raise PromotionConflict(self._conflict(model, version))
        # the champion this change replaces is the one at `current`, whatever happens meanwhile
        record = ChampionChange(generation=current + 1, version=version, action=action, reason=reason,
                                previous=self._champion_at(model, current), at=round(time.time(), 3))
        if not self.store.create(f"{model}/champion/g{current + 1:06d}.json", dump(record)):
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

    def promote(self, model: str, version: int, reason: str = "",
                expected_generation: int | None = None) -> ChampionChange:
        """Make `version` the champion. With `expected_generation` (what the caller saw when it
        decided), a champion that changed since is a PromotionConflict rather than overwritten."""
        return self._set_champion(model, version, "promote", expected_generation, reason)

    def rollback_target(self, model: str) -> int:
        """The version a rollback would make champion: the one before the current champion
        (repeatable: each rollback goes one promotion further back)."""
        stack: list[int] = []
        for record in self.history(model):
            if record.action == "promote":
                stack.append(record.version)
            elif stack:  # a rollback undoes the promotion before it
                stack.pop()
            else:
                raise RegistryCorrupt(f"{self.url}/{model}/champion/g{record.generation:06d}.json",
                                      "action: a rollback with no promotion before it")
        if len(stack) < 2:
            raise FatalError(f"{model}: there is no earlier champion to roll back to")
        return stack[-2]

    def rollback(self, model: str, reason: str = "", expected_generation: int | None = None) -> ChampionChange:
        """Make the champion before the current one the champion again."""
        generation = self.generation(model) if expected_generation is None else expected_generation
        return self._set_champion(model, self.rollback_target(model), "rollback", generation, reason)
