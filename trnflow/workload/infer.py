"""The offline batch-inference phase: embeddings of the inference set (or, for a recipe without
embeddings, its predictions), as Parquet shards.

The rows are cut into shards of `inference.shard_size`; rank r embeds shards r, r + world, ...
Each shard is written under `inference.output_url`, then its commit marker; rank 0 writes the
manifest last (the layout is `trnflow.workload.embeddings`'). A rerun skips every shard whose marker
matches its file and the current plan (same rows, same shard size, same model) and redoes the
others, so a run killed midway finishes without touching what was committed. Nothing is written
outside `output_url`. With `inference.generate`, each row's completion of its prompt is generated
too (`trnflow.workload.generate`) and written beside what the recipe publishes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from trnflow.results import InferResult, ShardWritten
from trnflow.specs import GenerateSpec, InferenceSpec
from trnflow.storage import Store, open_store
from trnflow.workload.checkpoint import Checkpoint
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.data import iter_unlabelled
from trnflow.workload.embeddings import MANIFEST, committed, marker_name, remove_beyond, shard_name
from trnflow.workload.evaluate import featurized, loaded
from trnflow.workload.features import Featurized, featurize, host_memory
from trnflow.workload.generate import Decoding, generate, rehearse
from trnflow.workload.recipes import Recipe
from trnflow.workload.sampler import static_batches


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    # Dictionary-encoding the float embeddings costs more than computing them and saves nothing;
    # only the repeated model version is worth a dictionary.
    pq.write_table(table, sink, use_dictionary=["model_version"])
    return sink.getvalue().to_pybytes()


def _column(values: torch.Tensor) -> pa.Array:
    """A tensor as an Arrow column, a row a value (1-d) or a fixed-size list (2-d), from its memory.
    (`pa.array` on a NumPy array would import pandas, about 0.3 s, on a worker's first shard.)"""
    flat = values.contiguous()
    dtype = {torch.float32: pa.float32(), torch.int64: pa.int64()}[flat.dtype]
    data = pa.Array.from_buffers(dtype, flat.numel(), [None, pa.py_buffer(flat.numpy())])
    return data if flat.dim() == 1 else pa.FixedSizeListArray.from_arrays(data, flat.shape[1])


def _shard_table(ids: pa.Array, out: torch.Tensor, version: str, recipe: Recipe,
                 generated: list[list[int]] | None = None) -> pa.Table:
    """One shard's rows: what the recipe publishes for each (`Recipe.publish`: an embedding, or a
    predicted class and the class probabilities, ...), and with `generated` (each row's generated
    tokens) its `completion` and how many tokens it took (`completion_tokens`)."""
    columns = {name: _column(values) for name, values in recipe.publish(out).items()}
    if generated is not None:
        columns["completion"] = pa.array(recipe.decode(generated), pa.string())
        columns["completion_tokens"] = _column(torch.tensor([len(g) for g in generated], dtype=torch.int64))
    return pa.table({"id": ids, **columns, "model_version": _repeated(version, len(ids))})


def _repeated(text: str, rows: int) -> pa.Array:
    """A string column holding `text` in each of `rows` rows, from its memory (`pa.array` on a list
    of strings would import pandas too)."""
    data = text.encode()
    offsets = torch.arange(rows + 1, dtype=torch.int32) * len(data)
    return pa.Array.from_buffers(pa.string(), rows, [None, pa.py_buffer(offsets.numpy()), pa.py_buffer(data * rows)])


def _outputs(program, batches, rows: int) -> torch.Tensor:
    """The program's outputs for `rows` rows, copied batch by batch into one tensor: a compiled
    program's output keeps more than itself alive, so a shard's outputs are not kept as a list."""
    values, done = None, 0
    for batch, real in batches:
        out = program(batch)[:real]
        if values is None:
            values = torch.empty(rows, *out.shape[1:], dtype=torch.float32)
        values[done:done + real] = out
        done += real
    assert values is not None and done == rows
    return values


@dataclass(frozen=True)
class _Job:
    """What every shard of one inference run is made with: the rows, the weights' version, the plan
    digest that names them, and where the shards go."""

    rows: Featurized
    version: str
    plan: str
    out: Store
    outputs: Callable[[torch.Tensor], torch.Tensor]
    """The program each batch goes through: embeddings, or predictions for a recipe without them."""
    recipe: Recipe
    rows_per_shard: int
    batch_size: int
    generating: GenerateSpec | None = None
    decoding: Callable[[], Decoding] | None = None
    """`inference.generate`, and how a generation gets each next token's logits (`Programs.decoding`)."""

    def generated(self, lo: int, hi: int) -> list[list[int]] | None:
        """The tokens generated for rows lo..hi (None when the spec generates nothing)."""
        if self.generating is None or self.decoding is None:
            return None
        ids = [str(i) for i in self.rows.ids.slice(lo, hi - lo).to_pylist()]
        tokens: list[list[int]] = []
        for batch, real in static_batches(self.rows.features, torch.arange(lo, hi), self.batch_size):
            names = ids[len(tokens):len(tokens) + real]
            names += [names[0]] * (len(batch) - real)  # a filled batch's copies of its first row
            tokens += generate(self.decoding(), self.recipe, batch, names, self.generating)[:real]
        return tokens

    @property
    def n_shards(self) -> int:
        return -(-len(self.rows) // self.rows_per_shard)


def _version(ckpt: Checkpoint) -> str:
    """What the outputs name as the model: `run/step-N`, or a plain state_dict file by its name and weights."""
    if ckpt.meta is None:
        return f"{ckpt.url.rsplit('/', 1)[-1]}@{ckpt.model_sha256[:12]}"
    return f"{ckpt.meta.run_id}/step-{ckpt.step}"


def _plan(rows: Featurized, spec_inference: InferenceSpec, ckpt: Checkpoint, version: str, recipe: Recipe) -> str:
    """The digest a committed shard is reused under: the same rows, weights, featurizer, shapes and
    generation settings."""
    generating = spec_inference.generate.model_dump(mode="json") if spec_inference.generate else None
    return hashlib.sha256(json.dumps([
        rows.digest, spec_inference.shard_size, spec_inference.batch_size, ckpt.model_sha256, version,
        hashlib.sha256(recipe.state()).hexdigest(), recipe.describe().model_dump(mode="json"),
        *([generating] if generating else []),
    ]).encode()).hexdigest()[:16]


def _warm_up(job: _Job, mine: list[int]) -> float:
    """Load the output program (trace it, take its graph from the compile cache) and build a one-row
    table (Arrow's first use imports its pandas layer, about 0.3 s) before the clock starts: rows/s
    is the steady rate, and the one-time load (seconds, returned) is reported on its own."""
    began = time.perf_counter()
    if mine:
        batch = next(static_batches(job.rows.features, torch.arange(1), job.batch_size))[0]
        first = job.outputs(batch)
        if job.decoding is not None and job.generating is not None:  # the generation's programs, once
            rehearse(job.decoding(), job.recipe, batch, job.generating)
        _parquet_bytes(_shard_table(job.rows.ids.slice(0, 1), first[:1].float(), job.version, job.recipe))
    return time.perf_counter() - began


def _write_shards(ctx: WorkerContext, job: _Job, mine: list[int], faults: Store
                  ) -> tuple[list[ShardWritten], int, float]:
    """Write this rank's shards, each then its commit marker, reusing those committed under the same
    plan; each shard as the manifest lists it, the rows embedded here, and the seconds it took."""
    shards, written, began = [], 0, time.perf_counter()
    for ordinal, shard in enumerate(mine, start=1):
        due = ctx.faults.strike(ordinal, lambda fault: faults.create(f"faults/infer-{fault.label}",
                                                                     ctx.faults.marker()), phase="infer")
        shard_store = ctx.faults.tearing(job.out) if "torn" in due else job.out  # a torn fault: killed mid-write
        lo, hi = shard * job.rows_per_shard, min((shard + 1) * job.rows_per_shard, len(job.rows))
        marker = committed(job.out, shard, job.plan)
        reused = marker is not None
        if marker is None:
            values = _outputs(job.outputs, static_batches(job.rows.features, torch.arange(lo, hi), job.batch_size),
                              hi - lo)
            data = _parquet_bytes(_shard_table(job.rows.ids.slice(lo, hi - lo), values, job.version, job.recipe,
                                               job.generated(lo, hi)))
            marker = {"shard": shard, "rows": hi - lo, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                      "plan": job.plan, "model_version": job.version}
            shard_store.write(f"{shard_name(shard)}.parquet", data)
            job.out.write(marker_name(shard), json.dumps(marker).encode())  # the commit, last
            written += hi - lo
        shards.append(ShardWritten(shard=shard, file=f"{shard_name(shard)}.parquet", rows=marker["rows"],
                                   sha256=marker["sha256"], reused=reused))
        elapsed = time.perf_counter() - began
        ctx.log("infer_shard", all_ranks=True, shard=shard, shards=job.n_shards, rows=hi - lo, reused=reused,
                rows_per_s=round(written / elapsed, 1) if elapsed else 0.0)
    return shards, written, time.perf_counter() - began


def _publish(job: _Job, checkpoint: str, shards: list[ShardWritten]) -> None:
    """Rank 0, once every shard is committed: drop what an earlier, larger inference set left beyond
    this one's shards, then write the manifest, which makes the output complete."""
    remove_beyond(job.out, job.n_shards)
    manifest = {"model_version": job.version, "checkpoint": checkpoint, "plan": job.plan, "rows": len(job.rows),
                "shard_size": job.rows_per_shard,
                "shards": [s.model_dump(exclude={"reused"}) for s in shards]}
    job.out.write(MANIFEST, json.dumps(manifest, indent=1).encode())


def run(ctx: WorkerContext, checkpoint: str) -> InferResult:
    spec = ctx.spec
    icfg = spec.inference
    recipe, ckpt, programs = loaded(ctx, checkpoint)
    version = _version(ckpt)
    # Streamed and featurized a batch at a time: an inference set of any size is never read whole.
    rows = featurize(iter_unlabelled(spec.data.inference, spec.data, recipe.columns()), featurized(recipe, ckpt),
                     id_field=spec.data.id_field, digest=True)
    assert rows.ids is not None
    out = open_store(icfg.output_url)
    job = _Job(rows=rows, version=version, plan=_plan(rows, icfg, ckpt, version, recipe), out=out, recipe=recipe,
               outputs=programs.embed if recipe.embeds else programs.logits,  # predictions, without embeddings
               rows_per_shard=icfg.shard_size, batch_size=icfg.batch_size, generating=icfg.generate,
               decoding=programs.decoding if icfg.generate else None)
    if ctx.is_main:
        out.delete(MANIFEST)  # the output is incomplete until the manifest is back
    mine = list(range(ctx.rank, job.n_shards, ctx.world_size))
    load_seconds = _warm_up(job, mine)
    shards, written, seconds = _write_shards(ctx, job, mine, open_store(ckpt.url.rpartition("/")[0]))
    everything = sorted((s for per_rank in gather_objects(ctx, shards) for s in per_rank), key=lambda s: s.shard)
    embedded = sum(gather_objects(ctx, written))
    memory = host_memory(ctx, rows.features)
    if ctx.is_main:
        _publish(job, ckpt.url, everything)
    return InferResult(
        output_url=icfg.output_url, model_version=version, rows=sum(s.rows for s in everything), shards=everything,
        published="embeddings" if recipe.embeds else "predictions", rows_embedded=embedded,
        shards_reused=sum(1 for s in everything if s.reused), manifest=f"{out.url}/{MANIFEST}",
        rows_per_s=round(embedded / seconds, 1) if seconds and embedded else 0.0,
        program_load_seconds=round(load_seconds, 3), host_memory=memory, compile=programs.compiler.metrics())
