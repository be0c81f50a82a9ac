"""The offline batch-inference phase: embeddings of the inference set (or, for a recipe without
embeddings, its predictions), as Parquet shards.

The rows are cut into shards of `inference.shard_size`; rank r embeds shards r, r + world, ...
Each shard is written under `inference.output_url`, then its commit marker; rank 0 writes the
manifest last (the layout is `trnflow.workload.embeddings`'). A rerun skips every shard whose marker
matches its file and the current plan (same rows, same shard size, same model) and redoes the
others, so a run killed midway finishes without touching what was committed. Nothing is written
outside `output_url`.
"""

from __future__ import annotations

import hashlib
import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from trnflow.storage import open_store
from trnflow.workload.checkpoint import load, load_model_weights
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.data import iter_unlabelled
from trnflow.workload.embeddings import MANIFEST, committed, marker_name, remove_beyond, shard_name
from trnflow.workload.evaluate import featurized
from trnflow.workload.features import featurize, host_memory
from trnflow.workload.programs import build_model, for_run
from trnflow.workload.recipes import Recipe, for_job
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


def _shard_table(ids: pa.Array, out: torch.Tensor, version: str, recipe: Recipe) -> pa.Table:
    """One shard's rows: what the recipe publishes for each (`Recipe.publish`: an embedding, or a
    predicted class and the class probabilities, ...)."""
    columns = {name: _column(values) for name, values in recipe.publish(out).items()}
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


def run(ctx: WorkerContext, checkpoint: str) -> dict:
    spec = ctx.spec
    icfg = spec.inference
    recipe = for_job(spec)
    ckpt = load(checkpoint, recipe.featurizer_file)
    model = build_model(recipe, spec.train.seed)
    load_model_weights(model, ckpt.model, ckpt.url)
    programs = for_run(ctx, recipe, model)
    run_url = ckpt.url.rpartition("/")[0]
    if ckpt.meta is None:  # a plain state_dict file: named by its file and weights
        version = f"{ckpt.url.rsplit('/', 1)[-1]}@{ckpt.model_sha256[:12]}"
    else:
        version = f"{ckpt.meta.run_id}/step-{ckpt.step}"

    # Streamed and featurized a batch at a time: an inference set of any size is never read whole.
    rows = featurize(iter_unlabelled(spec.data.inference, spec.data, recipe.columns()), featurized(recipe, ckpt),
                     id_field=spec.data.id_field, digest=True)
    tokens, ids = rows.features, rows.ids
    assert ids is not None
    # A shard can be reused only if it was made from the same rows by the same weights, featurizer
    # and shapes: the plan digests all of them.
    plan = hashlib.sha256(json.dumps([
        rows.digest, icfg.shard_size, icfg.batch_size, ckpt.model_sha256, version,
        hashlib.sha256(recipe.state()).hexdigest(), recipe.describe(),
    ]).encode()).hexdigest()[:16]
    out = open_store(icfg.output_url)
    if ctx.is_main:
        out.delete(MANIFEST)  # the output is incomplete until the manifest is back
    n_shards = -(-len(rows) // icfg.shard_size)
    mine = list(range(ctx.rank, n_shards, ctx.world_size))
    faults_store = open_store(run_url)
    # Load the embed program (trace it, take its graph from the compile cache) and build a one-row
    # table (Arrow's first use imports its pandas layer, about 0.3 s) before the clock starts:
    # rows/s is the steady rate, and the one-time load is reported on its own.
    loading = time.perf_counter()
    outputs = programs.embed if recipe.embeds else programs.logits  # predictions, for a recipe without embeddings
    if mine:
        first = outputs(next(static_batches(tokens, torch.arange(1), icfg.batch_size))[0])
        _parquet_bytes(_shard_table(ids.slice(0, 1), first[:1].float(), version, recipe))
    load_seconds = time.perf_counter() - loading
    shards, written, began = [], 0, time.perf_counter()
    for ordinal, shard in enumerate(mine, start=1):
        due = ctx.faults.strike(ordinal, lambda fault: faults_store.create(f"faults/infer-{fault.label}",
                                                                           ctx.faults.marker()), phase="infer")
        shard_store = ctx.faults.tearing(out) if "torn" in due else out  # a torn fault: killed mid-write
        lo, hi = shard * icfg.shard_size, min((shard + 1) * icfg.shard_size, len(rows))
        marker = committed(out, shard, plan)
        reused = marker is not None
        if marker is None:
            values = _outputs(outputs, static_batches(tokens, torch.arange(lo, hi), icfg.batch_size), hi - lo)
            data = _parquet_bytes(_shard_table(ids.slice(lo, hi - lo), values, version, recipe))
            marker = {"shard": shard, "rows": hi - lo, "sha256": hashlib.sha256(data).hexdigest(), "size": len(data),
                      "plan": plan, "model_version": version}
            shard_store.write(f"{shard_name(shard)}.parquet", data)
            out.write(marker_name(shard), json.dumps(marker).encode())  # the commit, last
            written += hi - lo
        shards.append({"shard": shard, "file": f"{shard_name(shard)}.parquet", "rows": marker["rows"],
                       "sha256": marker["sha256"], "reused": reused})
        elapsed = time.perf_counter() - began
        ctx.log("infer_shard", all_ranks=True, shard=shard, shards=n_shards, rows=hi - lo, reused=reused,
                rows_per_s=round(written / elapsed, 1) if elapsed else 0.0)
    seconds = time.perf_counter() - began
    everything = sorted((s for per_rank in gather_objects(ctx, shards) for s in per_rank), key=lambda s: s["shard"])
    counts = gather_objects(ctx, written)
    memory = host_memory(ctx, tokens)
    if ctx.is_main:
        remove_beyond(out, n_shards)  # shards of an earlier, larger inference set, and their markers
        manifest = {"model_version": version, "checkpoint": ckpt.url, "plan": plan, "rows": len(rows),
                    "shard_size": icfg.shard_size,
                    "shards": [{k: s[k] for k in ("shard", "file", "rows", "sha256")} for s in everything]}
        out.write(MANIFEST, json.dumps(manifest, indent=1).encode())
    total = sum(s["rows"] for s in everything)
    embedded = sum(counts)
    return {"output_url": icfg.output_url, "model_version": version, "rows": total, "shards": everything,
            "published": "embeddings" if recipe.embeds else "predictions",
            "rows_embedded": embedded, "shards_reused": sum(1 for s in everything if s["reused"]),
            "manifest": f"{out.url}/{MANIFEST}",
            "rows_per_s": round(embedded / seconds, 1) if seconds and embedded else 0.0,
            "program_load_seconds": round(load_seconds, 3), "host_memory": memory,
            "compile": programs.compiler.metrics().model_dump()}
