"""Where a spec's parity reference is: the metrics file `gate.reference` names, or with `auto` the
fp32 reference of this spec and its data, kept under the spec's checkpoints by a digest of what
decides its numbers (`reference_key`). A run whose key finds a reference on record reuses it; a
change to the training, the evaluation or the data makes a new one."""

from __future__ import annotations

import hashlib
import json

from trnflow.lifecycle.registry import Registry
from trnflow.specs import JobSpec
from trnflow.storage import open_store
from trnflow.storage.datafiles import data_files

AUTO = "auto"
FOLDER = "_reference"
"""Where automatic references are kept, under train.checkpoint_url: `_reference/<key>/`."""
TRAINING_ONLY = {"checkpoint_url", "max_minutes", "max_cost_usd", "log_every", "checkpoint_every", "checkpoint_async",
                  "keep_latest"}
"""train fields that change how a run is watched, bounded or kept, never its numbers."""


def reference_url(spec: JobSpec, key: str | None = None) -> str | None:
    """The metrics file the candidate is judged against: `gate.reference` when it names one, the
    automatic reference's place with `auto` (whether or not it is there yet; `key`: its
    `reference_key`, where the caller has it already), else None."""
    reference = spec.gate.reference
    if reference == AUTO:
        return f"{auto_folder(spec, key)}/metrics.json"
    return None if reference in (None, "champion") else reference


def auto_folder(spec: JobSpec, key: str | None = None) -> str:
    """`<train.checkpoint_url>/_reference/<key>`: the automatic reference's metrics file, and its
    training's checkpoints under `checkpoints/`."""
    return f"{spec.train.checkpoint_url.rstrip('/')}/{FOLDER}/{key or reference_key(spec)}"


def reference_key(spec: JobSpec) -> str:
    """A digest of what decides the fp32 reference's numbers: the model, the data's files and their
    sizes (a new day partition is another reference), the training (its seed, batch, schedule and
    starting weights: the champion's checkpoint where it starts from the champion), its device,
    instance type and cores, and the evaluation steps and metrics. Not the candidate's precision
    or compiler level (the reference is always fp32 at -O1), its layout (ddp, fsdp or tp compute
    the same maths: a reference serves each, which is what the gate checks), its name, budget,
    deadline, inference input or outputs."""
    train = spec.train.model_dump(mode="json", exclude=TRAINING_ONLY)
    for decided_once in ("strategy", "tp"):  # as written or as decided, one reference: the layouts' maths agree
        train["parallelism"].pop(decided_once)
    if spec.train.init_from == "champion" and spec.registry_url:
        champion = Registry(spec.registry_url).champion(spec.name)
        train["init_from"] = champion.checkpoint if champion else None
    decided = {
        "model": spec.model.model_dump(mode="json"),
        "data": spec.data.model_dump(mode="json", exclude={"inference"}),
        "files": {role: _listing(url, spec) for role, url in (("train", spec.data.train),
                                                              ("holdout", spec.data.holdout))},
        "train": train,
        "cores": [spec.compute.nodes, spec.compute.cores_per_node],
        "device": [spec.compute.device, spec.compute.instance_type],  # another device's numbers are others
        "gate": spec.gate.model_dump(mode="json", include={"metric", "metrics", "eval_every"}),
    }
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]


def _listing(url: str, spec: JobSpec) -> list[tuple[str, int]]:
    """Each file a run reads from `url`, with its size."""
    files = data_files(url, spec.data.format, spec.data.ready_marker)
    found = []
    for file in files:
        sizes = {o.name: o.size for o in file.store.list(file.name)}
        found.append((file.url, sizes.get(file.name, -1)))
    return found


def on_record(spec: JobSpec, url: str | None = None) -> bool:
    """Whether the automatic reference of this spec and data (at `url`, where one was decided) is
    there to judge against."""
    folder, _, name = (url or reference_url(spec) or "").rpartition("/")
    return bool(folder) and any(o.name == name for o in open_store(folder).list(name))
