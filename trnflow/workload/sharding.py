"""Sharded training's state: each rank's shard of the weights and optimizer state written and read
with `torch.distributed.checkpoint` (DCP), resharded on load over any number of ranks; and the
same state gathered whole, as plain tensors, for everything that is not a sharded run.

Under `train.parallelism.strategy: fsdp` each rank keeps 1/N of every weight and of its optimizer
state (DTensors). At a checkpoint each rank writes its own shard file (`__<rank>_0.distcp`) and rank
0 DCP's index (`.metadata`); nothing is gathered. Loading reads, on each rank, the parts of every
shard file that its new shard overlaps, so a run resumes at any world size. `consolidate` joins the
files into whole tensors in one process, without a process group: the `model.pt` that evaluation,
the registry, inference and plain PyTorch load.

DCP's own reader unpickles its index, and any non-tensor value, without restriction; here the
index is read by an unpickler that builds DCP's metadata records and nothing else, every
file it names must be a shard of the same folder, and values load with `weights_only=True`, so a
checkpoint another job wrote cannot run code. The optimizer's state is keyed by parameter name
(`get_optimizer_state_dict`), which needs no parameter order; a `ddp` checkpoint's, keyed by
position, is read by the same names.
"""

from __future__ import annotations

import contextlib
import io
import math
import pickle
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from trnflow.device.private_torch import (
    PICKLED_NAMES,
    empty_load_planner,
    in_parts,
    load_without_group,
    set_element,
    storage_info,
)

SHARD_NAME = re.compile(r"\.metadata|__[0-9]{1,6}_[0-9]{1,6}\.distcp")
"""The files of a DCP checkpoint's folder: its index, and one shard file per rank."""
METADATA = ".metadata"

WHOLE = StateDictOptions(full_state_dict=True)
"""Loading: every rank passes the whole state, and keeps its shard."""
WHOLE_ON_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
"""Saving: unsharded tensors in host memory, on rank 0 only (the others get nothing). Frozen
weights (a LoRA adapter's base) are left out of every state saved: they are the base's."""
SHARDED_ON_HOST = StateDictOptions(cpu_offload=True, ignore_frozen_params=True)
"""Saving shards: each rank's DTensors, their local parts copied to host memory."""
TRAINED = StateDictOptions(ignore_frozen_params=True)


def plain_name(name: str) -> str:
    """A weight's name as the bare model has it: without DDP's `module.` or torch.compile's `_orig_mod.`."""
    return name.removeprefix("module.").removeprefix("_orig_mod.")


def frozen(model: nn.Module) -> set[str]:
    """The state_dict names of the model's weights that do not train (a LoRA adapter's base), tied
    names included (a tied head's, which `ignore_frozen_params` keeps)."""
    return {plain_name(name) for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def trained_only(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` (the model's) without its frozen weights: what a checkpoint holds."""
    fixed = frozen(model)
    return {k: v for k, v in state.items() if plain_name(k) not in fixed} if fixed else state


def _loading(model: nn.Module, options: StateDictOptions | None = None) -> StateDictOptions:
    """`options` for loading a state saved without the model's frozen weights, if it has any."""
    options = options or StateDictOptions()
    if any(not p.requires_grad for p in model.parameters()):
        return StateDictOptions(**{**vars(options), "strict": False})
    return options


def whole_model(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights, unsharded, on rank 0 (a collective: every rank calls it)."""
    return trained_only(model, get_model_state_dict(model, options=WHOLE_ON_RANK0))


def load_whole(model: nn.Module, optimizer: torch.optim.Optimizer | None, weights: dict[str, torch.Tensor],
               state: dict[str, Any] | None) -> None:
    """Load unsharded weights (and optimizer state) into a sharded model: each rank keeps its shard.
    Every rank passes the whole state (a collective)."""
    set_model_state_dict(model, weights, options=_loading(model, WHOLE))  # its names checked by the caller
    if optimizer is not None and state is not None:
        set_optimizer_state_dict(model, optimizer, by_name(model, optimizer, state), options=WHOLE)


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state into an unsharded model's optimizer: as it was saved when
    keyed by position (a `ddp` checkpoint), by name when a sharded run saved it."""
    if _by_name(state):
        set_optimizer_state_dict(model, optimizer, state, options=WHOLE)
    else:
        optimizer.load_state_dict(state)


def _by_name(state: dict[str, Any]) -> bool:
    return all(isinstance(k, str) for k in state.get("state", {})) and all(
        isinstance(p, str) for g in state.get("param_groups", []) for p in g["params"])


def by_name(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name. One keyed by position (`optimizer.state_dict()`,
    as `ddp` saves it) is renamed through this optimizer's parameter groups, whose order it follows."""
    if _by_name(state):
        return state
    names = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
    position = {index: names[id(p)] for saved, group in zip(state["param_groups"], optimizer.param_groups, strict=True)
                for index, p in zip(saved["params"], group["params"], strict=True)}
    return {"state": {position[k]: v for k, v in state["state"].items()},
            "param_groups": [{**g, "params": [position[i] for i in g["params"]]} for g in state["param_groups"]]}


# The records DCP's index is built of; nothing else is ever constructed from it.
_RECORD_TYPES = frozenset({Metadata, MetadataIndex, StorageMeta, TensorProperties, TensorStorageMetadata,
                           ChunkStorageMetadata, BytesStorageMetadata, storage_info()})
_RECORDS = {(record.__module__, record.__name__) for record in _RECORD_TYPES}
_VALUES = {*PICKLED_NAMES, ("torch", "Size")}
_PATHS = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}


def _path_text(*parts: object) -> str:
    """A path in the index (the folder its writer used, which nothing reads), kept as plain text."""
    return "/".join(map(str, parts))


class _IndexUnpickler(pickle._Unpickler):  # the Python one: its BUILD can be checked
    """Builds DCP's index records and plain values, and nothing else: no other class or function is
    reachable, paths become text, and state is set only on instances of the records (never on a
    class, which would change it for the whole process)."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PATHS:
            return _path_text
        if (module, name) in _RECORDS or (module, name) in _VALUES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")

    def _build(self) -> None:
        state, target = self.stack[-1], self.stack[-2]
        own = type(target) is TensorProperties and type(state) is tuple  # its __setstate__ takes a tuple
        if isinstance(target, type) or type(target) not in _RECORD_TYPES or not (type(state) is dict or own):
            raise pickle.UnpicklingError("the index sets state on something that is not one of its records")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


def check_index(data: bytes, files: dict[str, int]) -> Metadata:
    """DCP's index, built of its own records alone (`_IndexUnpickler`), and checked against the shard
    files beside it (`files`: name -> size): every file it names is one of them, and no tensor it
    describes is larger than they are together, so a tampered index can neither read another file
    nor make a reader allocate without bound. ValueError says what is wrong."""
    try:
        metadata = _IndexUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # a refused global, truncation: the checkpoint is not one to load
        raise ValueError(f"the shard index is not one DCP wrote ({exc})") from None
    if type(metadata) is not Metadata:
        raise ValueError(f"the shard index holds a {type(metadata).__name__}, not DCP metadata")
    try:
        _check_index(metadata, files)
    except (AttributeError, TypeError, KeyError) as exc:  # a record of the wrong shape
        raise ValueError(f"the shard index is not one DCP wrote ({type(exc).__name__}: {exc})") from None
    return metadata


def _check_index(metadata: Metadata, files: dict[str, int]) -> None:
    if type(metadata.storage_data) is not dict or type(metadata.state_dict_metadata) is not dict:
        raise ValueError("the shard index is not one DCP wrote (its tables are not mappings)")
    for info in metadata.storage_data.values():
        if type(info) is not storage_info() or type(info.relative_path) is not str:
            raise ValueError("the shard index is not one DCP wrote (a part's location is not a file name)")
        if info.relative_path == METADATA or info.relative_path not in files:
            raise ValueError(f"the shard index names {info.relative_path!r}, which is not one of the checkpoint's "
                             "shard files")
        if type(info.offset) is not int or type(info.length) is not int or info.offset < 0 or info.length < 0 or \
                info.offset + info.length > files[info.relative_path]:
            raise ValueError(f"the shard index places a part outside {info.relative_path}")
        if info.transform_descriptors:
            raise ValueError("the shard index asks for transforms on read, which trnflow never writes")
    stored = sum(size for name, size in files.items() if name != METADATA)
    for name, item in metadata.state_dict_metadata.items():
        if type(item) is BytesStorageMetadata:
            continue
        if type(item) is not TensorStorageMetadata or not all(type(n) is int and n >= 0 for n in item.size):
            raise ValueError(f"the shard index describes {name!r} as neither a tensor nor a value")
        if math.prod(item.size) * item.properties.dtype.itemsize > stored:
            raise ValueError(f"the shard index makes {name!r} larger than every shard file together")
    limit = len(metadata.state_dict_metadata)
    for path in (metadata.planner_data or {}).values():  # where each value goes in the state dict
        if not all(type(key) is str or (type(key) is int and 0 <= key <= limit) for key in path):
            raise ValueError("the shard index places a value at an index no state dict has")


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, given the index already read and checked (`check_index`): DCP's own would unpickle it."""

    def __init__(self, folder: Path, metadata: Metadata):
        super().__init__(folder)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self._metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return self._metadata


class _Values:
    """Non-tensor values (the optimizer's hyperparameters) load as plain data, never as code."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:  # type: ignore[attr-defined]
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)  # type: ignore
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded  # type: ignore[attr-defined]


class _Planner(_Values, DefaultLoadPlanner):
    pass


class _WholePlanner(_Values, empty_load_planner()):
    pass


def _in_parts(value: Any) -> bool:
    """A DTensor split part by part (`private_torch.strided_shard`: GPT-2's fused query, key and value, each split
    over the cores): its local piece is not one box of the whole, which is all DCP's files can hold."""
    return isinstance(value, DTensor) and any(in_parts(p) for p in value.placements)


def _gathered_parts(tree: Any) -> Any:
    """`tree` (a state dict) with each DTensor split in parts gathered whole on every rank, in host
    memory: DCP saves it once, as any tensor every rank holds alike. A collective."""
    if _in_parts(tree):
        return tree.full_tensor().cpu()
    if isinstance(tree, dict):
        return {k: _gathered_parts(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_gathered_parts(v) for v in tree]
    return tree


def _whole_targets(tree: Any, found: list[tuple[DTensor, torch.Tensor]]) -> Any:
    """`tree` with each DTensor split in parts replaced by a whole tensor for DCP to read into, each
    pair (the DTensor, its whole target) appended to `found` for `_split_back`."""
    if _in_parts(tree):
        whole = torch.empty(tree.shape, dtype=tree.dtype)
        found.append((tree, whole))
        return whole
    if isinstance(tree, dict):
        return {k: _whole_targets(v, found) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_whole_targets(v, found) for v in tree]
    return tree


def _split_back(found: list[tuple[DTensor, torch.Tensor]], tree: Any) -> Any:
    """`tree` (loaded) with each whole target read by DCP split again as its DTensor is, in place."""
    for split, whole in found:
        part = distribute_tensor(whole.to(split.device), split.device_mesh, split.placements).to_local()
        split.to_local().copy_(part)
    swap = {id(whole): split for split, whole in found}

    def back(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in swap:
            return swap[id(value)]
        if isinstance(value, dict):
            return {k: back(v) for k, v in value.items()}
        if isinstance(value, list):
            return [back(v) for v in value]
        return value

    return back(tree)


def shard_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shard of the weights and optimizer state, in host memory, as `write_shards`
    saves it. A collective (a split layer's parts are gathered whole)."""
    return _gathered_parts({"model": trained_only(model, get_model_state_dict(model, options=SHARDED_ON_HOST)),
                            "optim": get_optimizer_state_dict(model, optimizer, options=SHARDED_ON_HOST)})


def write_shards(state: dict[str, Any], folder: Path, group: Any = None) -> dict[str, bytes]:
    """Write this rank's `shard_state` into `folder` (a local folder of this rank's own), and on
    rank 0 the index too; the files written, by name. A collective, over `group` (the default
    process group when None)."""
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, thread_count=1, sync_files=False),
             process_group=group, no_dist=not torch.distributed.is_initialized())  # (no group: a test's one process)
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if SHARD_NAME.fullmatch(path.name)}


def save_shards(model: nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> dict[str, bytes]:
    """`shard_state` written by `write_shards`: as the step ends."""
    return write_shards(shard_state(model, optimizer), folder)


def _unpacked(files: dict[str, bytes], folder: Path) -> _Reader:
    """A reader of the shard files `files`, put in `folder`, once their index passed its checks."""
    if METADATA not in files:
        raise ValueError("the shards have no index (.metadata)")
    metadata = check_index(files[METADATA], {name: len(data) for name, data in files.items()})
    for name, data in files.items():
        if not SHARD_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not a shard file")
        (folder / name).write_bytes(data)
    return _Reader(folder, metadata)


@contextlib.contextmanager
def _read_errors() -> Iterator[None]:
    """DCP's failures to read (a CheckpointException, which is not an Exception) as ValueError."""
    try:
        yield
    except CheckpointException as exc:
        raise ValueError(f"the shards could not be read ({str(exc).splitlines()[0][:300]})") from None


def load_shards(model: nn.Module, optimizer: torch.optim.Optimizer, files: dict[str, bytes]) -> None:
    """Load a sharded checkpoint's files (verified by the caller) into a sharded model and its
    optimizer, each rank taking its shard of the new layout whatever the world size that wrote
    them. A collective; ValueError when the shards cannot be read."""
    found: list[tuple[DTensor, torch.Tensor]] = []
    state = _whole_targets({"model": trained_only(model, get_model_state_dict(model, options=TRAINED)),
                            "optim": get_optimizer_state_dict(model, optimizer)}, found)
    with tempfile.TemporaryDirectory(prefix="trnflow-shards-") as tmp, _read_errors():
        dcp.load(state, storage_reader=_unpacked(files, Path(tmp)), planner=_Planner())
    state = _split_back(found, state)
    set_model_state_dict(model, state["model"], options=_loading(model))
    set_optimizer_state_dict(model, optimizer, state["optim"])


def consolidate(files: dict[str, bytes]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A sharded checkpoint's weights and optimizer state (keyed by name), whole, as plain tensors;
    in this process alone, with no process group."""
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="trnflow-shards-") as tmp, _read_errors():
        load_without_group(state, _unpacked(files, Path(tmp)), _WholePlanner())
    if set(state) != {"model", "optim"}:
        raise ValueError(f"the shards hold {sorted(state)}, not a model and its optimizer")
    return state["model"], state["optim"]
