"""Checkpoints: written under one commit protocol, counted only once their commit marker exists.

Layout under `<checkpoint_url>/<run_id>/` (a local folder or an S3 prefix):

    step-000040/model.pt         plain model state_dict (loads in any PyTorch program)
    step-000040/optim.pt         optimizer state_dict
    step-000040/state.pt         every rank's RNG states
    step-000040/<featurizer>     the recipe's featurizer (m5-text: tokenizer.json, its tokenizer)
    step-000040/meta.json        step, sampler position, lineage, data watermark, metrics so far
    step-000040/COMMITTED        written last: the sha256 and size of each file above

A sharded run (`train.parallelism.strategy: fsdp`) writes, instead of `model.pt` and `optim.pt`,
each rank's shard of both (`shards/__<rank>_0.distcp`, written by that rank) and DCP's index
(`shards/.metadata`); its last checkpoint, and one `trnflow checkpoint consolidate` ran on, hold the
whole weights as `model.pt` too. The marker, written by rank 0 once every rank's shard is stored,
lists every shard's checksum and says `"layout": "sharded"`.

A folder without its marker is a torn write: it is ignored, and deleted by the next save. A
marker whose checksums do not match is a corrupted checkpoint and is skipped too. Tensors are
loaded with `weights_only=True`, and a shard index only as DCP's records (`sharding`), so a
checkpoint cannot run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import pickle
import re
import reprlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trnflow.errors import FatalError
from trnflow.lifecycle.digests import registered_as
from trnflow.records import CHECKPOINT_MARKER, CheckpointMeta, dump, manifest_digest, read
from trnflow.storage import Store, open_store
from trnflow.workload import sharding
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.sharding import frozen, plain_name, trained_only

MARKER = CHECKPOINT_MARKER
_PREFIX = "step-"


def step_name(step: int) -> str:
    return f"{_PREFIX}{step:06d}"


REQUIRED = ("model.pt", "optim.pt", "state.pt", "meta.json")
"""Every checkpoint's files, besides its one featurizer file (named by the recipe)."""
SHARDS = "shards/"
SHARDED_REQUIRED = ("state.pt", "meta.json", f"{SHARDS}{sharding.METADATA}")
"""A sharded checkpoint's, besides its shard files, its featurizer and, when consolidated, `model.pt`."""


def _tensor_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """The sha256 of a state dict's tensors (names, dtypes, shapes and values, on the host): equal
    exactly when the weights are, however and wherever they were saved."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
"""A file a marker may list: a plain name in the checkpoint's folder."""
_STEP_FOLDER = re.compile(re.escape(_PREFIX) + r"[0-9]{1,15}")


def _digest(data: bytes) -> dict:
    return {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}


CHUNK = 8 << 20
"""Bytes a write passes on at a time (`_Hashing`), each then told to its pace, if any."""


class _Hashing:
    """A file written through, hashing what passes; with `pace`, told of every `CHUNK` written
    (which may wait before the next)."""

    def __init__(self, file: Any, pace: Callable[[int], None] | None = None):
        self.file, self.sha256, self.size, self.pace = file, hashlib.sha256(), 0, pace

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), CHUNK):
            chunk = view[at:at + CHUNK]
            self.sha256.update(chunk)
            self.file.write(chunk)
            self.size += len(chunk)
            if self.pace is not None:
                self.pace(len(chunk))
        return len(view)

    def flush(self) -> None:
        self.file.flush()

    def digest(self) -> dict:
        return {"sha256": self.sha256.hexdigest(), "size": self.size}


class Checkpoint:
    """What a checkpoint holds. `optim` and `rng` are None for a plain state_dict, and `featurizer`
    too when no featurizer file lies beside it. A sharded checkpoint keeps its shard files
    (`shards`, verified); its `model` and `optim` are joined whole from them when first asked for,
    unless it holds `model.pt`."""

    def __init__(self, url: str, step: int, model: dict | None = None, optim: dict | None = None,
                 rng: list[dict] | None = None, featurizer: bytes | None = None, featurizer_file: str | None = None,
                 meta: CheckpointMeta | None = None, model_sha256: str = "", shards: dict[str, bytes] | None = None):
        self.url, self.step, self.rng, self.meta = url, step, rng, meta
        """`meta` is None for a plain state_dict file, which says nothing of where it came from."""
        self.featurizer, self.featurizer_file = featurizer, featurizer_file
        self.model_sha256 = model_sha256
        """The digest of the weights file (of the shard files, when sharded): it tells two models apart
        whatever their names."""
        self.shards = shards
        self._model, self._optim = model, optim

    def _join(self) -> None:
        assert self.shards is not None
        try:
            model, optim = sharding.consolidate(self.shards)
        except ValueError as exc:
            raise FatalError(f"{self.url}: its shards cannot be joined ({exc}); the checkpoint is damaged, use an "
                             "earlier one") from None
        self._model = self._model if self._model is not None else model
        self._optim = self._optim if self._optim is not None else optim

    @property
    def model(self) -> dict:
        if self._model is None and self.shards is not None:
            self._join()
        assert self._model is not None
        return self._model

    @property
    def optim(self) -> dict | None:
        if self._optim is None and self.shards is not None:
            self._join()
        return self._optim

    @property
    def sharded(self) -> bool:
        return self.shards is not None

    @property
    def consolidated(self) -> bool:
        """A sharded checkpoint that holds its whole weights (`model.pt`) beside its shards."""
        return self.shards is not None and self._model is not None

    @property
    def resumable(self) -> bool:
        """Whether it holds an optimizer's state to resume from (without joining shards to tell)."""
        return self._optim is not None or self.shards is not None

    @property
    def watermark(self) -> str | None:
        return self.meta.watermark if self.meta else None


class RunCheckpoints:
    """The checkpoints of one run: save, find the newest good one, keep only the latest few."""

    def __init__(self, run_url: str, store: Store | None = None, featurizer_file: str | None = None):
        self.url = run_url.rstrip("/")
        self.store = store or open_store(self.url)
        self.featurizer_file = featurizer_file

    def _folders(self) -> dict[str, set[str]]:
        folders: dict[str, set[str]] = {}
        for obj in self.store.list(_PREFIX):
            folder, _, name = obj.name.partition("/")
            folders.setdefault(folder, set()).add(name)
        return folders

    def committed(self) -> list[int]:
        """The steps of the folders holding a marker (a folder named otherwise is none of trnflow's)."""
        return sorted(int(f.removeprefix(_PREFIX)) for f, names in self._folders().items()
                      if MARKER in names and _STEP_FOLDER.fullmatch(f))

    def latest(self, on_skip=None) -> Checkpoint | None:
        """The newest committed checkpoint that passes its checksums and can be resumed;
        `on_skip(url, reason)` hears of each one passed over."""
        for step in reversed(self.committed()):
            url = f"{self.url}/{step_name(step)}"
            try:
                ckpt = load(url, self.featurizer_file)
                if not ckpt.resumable:
                    raise FatalError(f"{url}: has no optimizer state to resume from (written by an older trnflow?)")
                return ckpt
            except FatalError as exc:
                if on_skip:
                    on_skip(url, str(exc))
        return None

    def clear(self, step: int) -> None:
        """Delete what an earlier attempt left of the checkpoint at `step` (a torn write)."""
        self.store.delete_prefix(f"{step_name(step)}/")

    def write_shards(self, step: int, files: dict[str, bytes]) -> dict[str, dict]:
        """Store one rank's shard files of the checkpoint at `step`; their names in the folder, with
        the checksums the marker will list."""
        listed = {}
        for name, data in files.items():
            self.store.write(f"{step_name(step)}/{SHARDS}{name}", data)
            listed[f"{SHARDS}{name}"] = _digest(data)
        return listed

    def save(self, step: int, model: dict | None, optim: dict | None, rng: list[dict], featurizer: tuple[str, bytes],
             meta: CheckpointMeta, keep_latest: int | None = None, shards: dict[str, dict] | None = None,
             pace: Callable[[int], None] | None = None) -> str:
        """Write one checkpoint, marker last; then delete torn folders and all but the newest
        `keep_latest` committed ones. Returns the checkpoint's URL. A sharded checkpoint's shard files
        are stored first, by every rank (`clear`, then `write_shards`), and passed as `shards` with
        their checksums; it then has no `optim`, and `model` (the whole weights) is optional. `pace`
        is told of the weights' and optimizer state's bytes as they are written (`writer.Pace`)."""
        listed = self.write_files(step, model, optim, rng, featurizer, shards, pace)
        return self.commit(step, listed, meta, keep_latest, shards)

    def write_files(self, step: int, model: dict | None, optim: dict | None, rng: list[dict],
                    featurizer: tuple[str, bytes], shards: dict[str, dict] | None = None,
                    pace: Callable[[int], None] | None = None) -> dict[str, dict]:
        """`save`'s first part: every file of the checkpoint of `step` but its meta and marker (the
        checkpoint is not committed yet); their checksums, for `commit`."""
        folder = step_name(step)
        if shards is None:
            self.clear(step)
            assert model is not None and optim is not None, "a whole checkpoint holds its model and optimizer"
        tensors = {name: obj for name, obj in (("model.pt", model), ("optim.pt", optim)) if obj is not None}
        files = {"state.pt": _tensor_bytes({"step": step, "world_size": len(rng), "rng": rng}),
                 featurizer[0]: featurizer[1]}
        with self._whole_or_none(step):
            listed = {name: self._stream(f"{folder}/{name}", obj, pace) for name, obj in tensors.items()}
            for name, data in files.items():
                self.store.write(f"{folder}/{name}", data)
                listed[name] = _digest(data)
        return listed

    def commit(self, step: int, listed: dict[str, dict], meta: CheckpointMeta | Callable[[], CheckpointMeta],
               keep_latest: int | None = None, shards: dict[str, dict] | None = None) -> str:
        """`save`'s second part, once `write_files` has written the files `listed`: the meta, then the
        marker; then the pruning. The checkpoint's URL. `meta` may be what waits for it (the run's last
        checkpoint's, known once its evaluation is done): if that fails, no folder is left either."""
        folder = step_name(step)
        with self._whole_or_none(step):
            meta = meta() if callable(meta) else meta
            data = dump(meta.model_copy(update={"step": step, "saved_at": round(time.time(), 3)}))
            self.store.write(f"{folder}/meta.json", data)
            files = {**(shards or {}), **listed, "meta.json": _digest(data)}
            marker = {"step": step, "layout": "sharded" if shards else "whole", "files": files}
            self.store.write(f"{folder}/{MARKER}", json.dumps(marker, indent=2).encode())
        self.prune(keep_latest, newest=step)
        return f"{self.url}/{folder}"

    @contextlib.contextmanager
    def _whole_or_none(self, step: int) -> Iterator[None]:
        """A full disk, a lost bucket, an interrupt while the checkpoint of `step` is written: leave no
        torn folder behind (if it cannot go now, the next save deletes it); the error is raised."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.clear(step)
            raise

    def _stream(self, name: str, obj: Any, pace: Callable[[int], None] | None = None) -> dict:
        """`torch.save` `obj` straight into the store's object `name`, hashed on its way: the large
        files are never held whole in memory, nor read again to be hashed. Their checksum for the marker."""
        with self.store.writing(name) as file:
            hashing = _Hashing(file, pace)
            torch.save(obj, hashing)
        return hashing.digest()

    def prune(self, keep_latest: int | None, newest: int) -> list[str]:
        """Delete torn folders, committed ones after `newest` (the step just saved: anything later
        belongs to an attempt that was resumed from an earlier checkpoint, because it was corrupt),
        and all but the newest `keep_latest` of the rest. `newest` itself is always kept. A
        committed checkpoint loses its marker first, so it is never seen half-deleted."""
        removed = []
        kept = [s for s in self.committed() if s <= newest]
        doomed = {s for s in self.committed() if s > newest}
        if keep_latest:
            doomed |= set(kept[:-keep_latest])
        doomed.discard(newest)
        for folder, names in sorted(self._folders().items()):
            if MARKER not in names or int(folder.removeprefix(_PREFIX)) in doomed:
                self.store.delete(f"{folder}/{MARKER}")
                self.store.delete_prefix(f"{folder}/")
                removed.append(folder)
        return removed


def _load_tensors(data: bytes, source: str) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # weights_only refused it: never retried without
        raise FatalError(f"{source}: holds pickled Python objects besides tensors, which trnflow never loads (they "
                         "could run code). Re-save it as a plain state_dict: torch.save(model.state_dict(), path)"
                         ) from None
    except Exception as exc:  # truncation, not a torch file at all
        raise FatalError(f"{source}: not a complete PyTorch file ({type(exc).__name__}); copy it again, or use an "
                         "earlier checkpoint") from None


def _read(store: Store, name: str, source: str) -> bytes:
    try:
        return store.read(name)
    except FileNotFoundError:
        raise FatalError(f"{source}: not found; check the checkpoint URL") from None


def load_checked(ctx: WorkerContext, url: str, featurizer_file: str | None = None) -> Checkpoint:
    """`load`, where `url` is a registered version's checkpoint only once its marker is the one the
    registry recorded (`trnflow.lifecycle.digests`): a file changed since it was registered stops the
    job, naming the version and the file. Rank 0 looks the version up and tells the others."""
    spec = ctx.spec
    found = registered_as(spec.registry_url, spec.name, url) if ctx.is_main else None
    pinned = gather_objects(ctx, None if found is None else (found.version, found.entry.digests))[0]
    if pinned is None:
        return load(url, featurizer_file)
    number, digests = pinned
    who = f"{spec.name} v{number}"
    if digests is None:
        raise FatalError(f"{who}: registered without digests of its files (by hand, or by an older trnflow), so "
                         f"nothing shows {url} is the checkpoint that was registered; register it again from a run")
    try:
        return load(url, featurizer_file, digest=digests.checkpoint)
    except FatalError as exc:
        raise FatalError(f"{who}: {exc}") from None


def load(url: str, featurizer_file: str | None = None, digest: str | None = None) -> Checkpoint:
    """A trnflow checkpoint folder, or a plain `state_dict` file saved by any PyTorch program (the
    recipe's `featurizer_file` beside that file is used when there is one). With `featurizer_file`,
    a checkpoint whose featurizer is another recipe's is refused; with `digest` (a registered
    version's), a folder whose marker lists other files than it did then."""
    url = url.rstrip("/")
    base, _, last = url.rpartition("/")
    if "." in last and not last.startswith(_PREFIX):  # a file: model.pt, weights.bin, ...
        return _load_state_dict(open_store(base), last, url, featurizer_file)
    return _load_folder(url, featurizer_file, digest)


def _load_state_dict(parent: Store, name: str, url: str, featurizer_file: str | None) -> Checkpoint:
    """A plain `state_dict` file (`name` in `parent`), with the recipe's featurizer beside it if any."""
    raw = _read(parent, name, url)
    state = _load_tensors(raw, url)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FatalError(f"{url}: expected a state_dict (a mapping of names to tensors), "
                         f"got {type(state).__name__}")
    try:
        featurizer = parent.read(featurizer_file) if featurizer_file else None
    except FileNotFoundError:
        featurizer = None
    return Checkpoint(url, 0, state, featurizer=featurizer, featurizer_file=featurizer_file,
                      model_sha256=hashlib.sha256(raw).hexdigest())


def _load_folder(url: str, featurizer_file: str | None, digest: str | None) -> Checkpoint:
    """A committed checkpoint folder, whole or sharded: every file its marker lists, each checked
    against its checksum before any is unpickled."""
    store = open_store(url)
    marker, listed = _marker(store, url)
    if digest is not None and manifest_digest(listed) != digest:
        raise FatalError(f"{url}/{MARKER} lists other files than when the checkpoint was registered, so it was "
                         "changed since and is not loaded; use another version (`trnflow models ls`)")
    sharded = marker.get("layout") == "sharded"
    shard_files = [name for name in listed if name.startswith(SHARDS)]
    featurizer = _listed_featurizer(url, listed, sharded, shard_files, featurizer_file)
    files = _verified_files(store, url, listed)
    if sharded:
        try:
            sharding.check_index(files[f"{SHARDS}{sharding.METADATA}"],
                                 {name.removeprefix(SHARDS): len(files[name]) for name in shard_files})
        except ValueError as exc:
            raise FatalError(f"{url}/{SHARDS}{sharding.METADATA}: {exc}; the checkpoint is damaged or tampered with, "
                             "so it is skipped: use an earlier one") from None
    state = _load_tensors(files["state.pt"], f"{url}/state.pt")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "rng" not in state:
        raise FatalError(f"{url}/state.pt: has no step number and RNG states; use an earlier checkpoint")
    meta = read(CheckpointMeta, files["meta.json"], f"{url}/meta.json",
                fix="the checkpoint is damaged or was written by another version of trnflow; use an earlier one")
    tensors = {name: _load_tensors(files[name], f"{url}/{name}") for name in ("model.pt", "optim.pt") if name in files}
    return Checkpoint(
        url, state["step"],
        model=tensors.get("model.pt"),
        optim=tensors.get("optim.pt"),
        rng=state["rng"],
        featurizer=files[featurizer],
        featurizer_file=featurizer,
        meta=meta,
        model_sha256=_shards_digest(listed, shard_files) if sharded else listed["model.pt"]["sha256"],
        shards={name.removeprefix(SHARDS): files[name] for name in shard_files} if sharded else None,
    )


def _listed_featurizer(url: str, listed: dict, sharded: bool, shard_files: list[str],
                       featurizer_file: str | None) -> str:
    """The featurizer file a checkpoint's marker lists, once the listing is checked: only files of
    the folder itself, every file a (sharded) checkpoint needs, and exactly one other, which is
    `featurizer_file` when one is asked for."""
    strays = [name for name in listed if not (_PLAIN_NAME.fullmatch(name) or (
        sharded and name.startswith(SHARDS) and sharding.SHARD_NAME.fullmatch(name.removeprefix(SHARDS))))]
    if strays:  # `../../x`, `/etc/passwd`: the checkpoint's own folder holds every file it lists
        raise FatalError(f"{url}/{MARKER}: lists {reprlib.repr(strays[0])}, which is not a file of the checkpoint's "
                         "folder; the checkpoint is damaged or tampered with, so it is skipped: use an earlier one")
    required = SHARDED_REQUIRED if sharded else REQUIRED
    if not set(required) <= set(listed) or (sharded and len(shard_files) < 2):
        raise FatalError(f"{url}/{MARKER}: lists {reprlib.repr(sorted(listed))}, not every file of a "
                         f"{'sharded ' if sharded else ''}checkpoint ({', '.join(required)}); the checkpoint is "
                         "damaged or was written by an older trnflow. Use an earlier one or retrain")
    outside = sorted(set(listed) - set(required) - set(shard_files) - ({"model.pt", "optim.pt"} if sharded else set()))
    if len(outside) != 1:
        raise FatalError(f"{url}/{MARKER}: lists {outside or 'no file'} besides {list(required)}, where a "
                         "checkpoint holds its one featurizer file; the checkpoint is damaged or tampered with, use "
                         "an earlier one")
    if featurizer_file and outside[0] != featurizer_file:
        raise FatalError(f"{url}: holds the featurizer {outside[0]}, but the spec's recipe keeps {featurizer_file}: "
                         "it was trained with another recipe. Set model.recipe to the one it was trained with, or "
                         "start from scratch (train.init_from: null)")
    return outside[0]


def _verified_files(store: Store, url: str, listed: dict) -> dict[str, bytes]:
    """Every file the marker lists, each read and checked against its checksum."""
    files = {}
    for name, expected in listed.items():
        data = _read(store, name, f"{url}/{name}")
        if _digest(data) != expected:
            raise FatalError(f"{url}/{name}: does not match its checksum in {MARKER}; the checkpoint is corrupted, "
                             "use an earlier one")
        files[name] = data
    return files


def _marker(store: Store, url: str) -> tuple[dict, dict]:
    """A checkpoint's marker and the files it lists, each with a sha256."""
    try:
        marker = json.loads(store.read(MARKER))
        listed = marker["files"]
        if not isinstance(listed, dict):
            raise ValueError(f"its files are a {type(listed).__name__}")
        if not all(isinstance(v, dict) and isinstance(v.get("sha256"), str) for v in listed.values()):
            raise ValueError("a file's checksum is not a sha256")
    except FileNotFoundError:
        raise FatalError(f"{url}: not a committed checkpoint (no {MARKER} marker); pick another checkpoint") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise FatalError(f"{url}/{MARKER}: not a marker this version of trnflow understands ({exc}); the "
                         "checkpoint is damaged or was written by an older trnflow. Use an earlier one or retrain"
                         ) from None
    return marker, listed


def _shards_digest(listed: dict, names: list[str]) -> str:
    """A sharded checkpoint's identity: the digest of its shard files' checksums."""
    return hashlib.sha256("".join(f"{n}:{listed[n]['sha256']}\n" for n in sorted(names)).encode()).hexdigest()


def consolidate(url: str) -> tuple[str, bool, Checkpoint]:
    """Join a committed sharded checkpoint's weights into its `model.pt`, which plain PyTorch loads,
    and list it in the marker (rewritten last). The URL of `model.pt`, whether it was written now
    (False: the checkpoint already held it, or is not sharded), and the checkpoint. A checkpoint
    whose marker changed meanwhile (a run pruned it, or consolidated it) is left as it is."""
    url = url.rstrip("/")
    ckpt = load(url)
    if not ckpt.sharded or ckpt.consolidated:
        return f"{url}/model.pt", False, ckpt
    store = open_store(url)
    before = store.read(MARKER)
    data = _tensor_bytes(ckpt.model)
    try:
        now = store.read(MARKER)
    except FileNotFoundError:
        now = b""
    if now != before:
        raise FatalError(f"{url}: its marker changed while its shards were joined (a run deleted or rewrote it); "
                         "nothing was written. Run the command again, or pick a checkpoint no run is writing")
    marker, listed = _marker(store, url)
    store.write("model.pt", data)
    marker["files"] = {**listed, "model.pt": _digest(data)}
    store.write(MARKER, json.dumps(marker, indent=2).encode())
    return f"{url}/model.pt", True, ckpt


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights that train: what the optimizer is given."""
    return [p for p in model.parameters() if p.requires_grad]


def trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict without its frozen weights: what a checkpoint holds."""
    return trained_only(model, model.state_dict())


def on_base(ckpt: Checkpoint, base: str | None) -> bool:
    """Whether `ckpt` may leave out the frozen weights of a model built on `base` (the recipe's
    `base()`): it was trained on that same base. FatalError, naming both digests, when it was trained
    on another, or when it is an adapter and the spec's model has none."""
    theirs = ckpt.meta.base if ckpt.meta is not None else None
    if theirs is None or base == theirs:
        return theirs is not None
    if base is None:
        raise FatalError(f"{ckpt.url}: holds adapters trained on a frozen base (digest {theirs}), but the spec's "
                         "model trains every weight; set model.params.lora and the pretrained folder it was trained on")
    raise FatalError(f"{ckpt.url}: its adapters were trained on the base with digest {theirs}, but the spec's "
                     f"model.params.pretrained has digest {base}; point it at the folder the adapters were trained on, "
                     "or start new adapters (train.init_from: null)")


def _mismatch(source: str, missing: list[str], unexpected: list[str]) -> FatalError:
    return FatalError(f"{source}: does not match the spec's model (missing {missing[:5]}, unexpected "
                      f"{unexpected[:5]}); check the model section")


def check_weights(model: torch.nn.Module, state: dict, source: str, without_frozen: bool = False) -> dict:
    """`state` with its keys as the model names them, refused (as `load_model_weights` refuses it)
    when its names or shapes are not the model's; for loading into a sharded model, whose own
    `load_state_dict` is not given whole tensors. `without_frozen`: the frozen weights may be left
    out (a checkpoint of adapters on the model's own base, `on_base`)."""
    state = {plain_name(k): v for k, v in state.items()}
    wanted = model.state_dict()
    missing, unexpected = sorted(set(wanted) - set(state)), sorted(set(state) - set(wanted))
    if without_frozen:
        missing = sorted(set(missing) - frozen(model))
    if missing or unexpected:
        raise _mismatch(source, missing, unexpected)
    wrong = [f"{k}: {tuple(v.shape)} for {tuple(wanted[k].shape)}" for k, v in state.items()
             if tuple(v.shape) != tuple(wanted[k].shape)]
    if wrong:
        raise FatalError(f"{source}: does not match the spec's model: {'; '.join(wrong[:3])}. Set model.params to "
                         "the shapes the checkpoint was trained with, or start from scratch (train.init_from: null)")
    return state


def load_model_weights(model: torch.nn.Module, state: dict, source: str, without_frozen: bool = False) -> None:
    """Load weights, turning shape or key mismatches into an error that says which keys.
    `without_frozen`: as `check_weights`."""
    state = {plain_name(k): v for k, v in state.items()}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        raise FatalError(f"{source}: does not match the spec's model: {str(exc)[:500]}. Set model.params to "
                         "the shapes the checkpoint was trained with, or start from scratch (train.init_from: null)"
                         ) from None
    missing = sorted(set(result.missing_keys) - frozen(model)) if without_frozen else result.missing_keys
    if missing or result.unexpected_keys:
        raise _mismatch(source, missing, result.unexpected_keys)
