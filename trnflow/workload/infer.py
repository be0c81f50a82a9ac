"""The offline batch-inference phase: embeddings of the inference set, written as Parquet shards.

Rows are split into shards of `inference.shard_size`; shard i is written by rank i % world as
`part-<i>.parquet`, atomically (temporary file, then rename).
"""

from __future__ import annotations

import time

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from trnflow.fsutil import atomic_write_bytes
from trnflow.storage import local_path
from trnflow.workload.checkpoint import load_checkpoint, load_model_weights
from trnflow.workload.context import WorkerContext, gather_objects
from trnflow.workload.data import HashingTokenizer, load_unlabelled, static_batches
from trnflow.workload.model import build_model
from trnflow.workload.programs import for_run


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def run(ctx: WorkerContext, checkpoint: str) -> dict:
    spec = ctx.spec
    cfg, icfg = spec.model, spec.inference
    source = local_path(checkpoint)
    ckpt = load_checkpoint(source)
    model = build_model(cfg, spec.train.seed)
    load_model_weights(model, ckpt.model, source)
    programs = for_run(ctx, model)
    version = f"{ckpt.meta.get('run_id', source.parent.name)}/step-{ckpt.step}"

    rows = load_unlabelled(spec.data.inference, spec.data, HashingTokenizer(cfg.vocab_size, cfg.seq_len))
    out_dir = local_path(icfg.output_url)
    n_shards = -(-len(rows.ids) // icfg.shard_size)
    written, began = [], time.perf_counter()
    for shard in range(ctx.rank, n_shards, ctx.world_size):
        lo, hi = shard * icfg.shard_size, min((shard + 1) * icfg.shard_size, len(rows.ids))
        batches = static_batches(rows.tokens, torch.arange(lo, hi), icfg.batch_size)
        emb = torch.cat([programs.embed(batch)[:real] for batch, real in batches]).float().numpy()
        table = pa.table({
            "id": pa.array(rows.ids[lo:hi]),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1]),
            "model_version": pa.array([version] * (hi - lo)),
        })
        path = atomic_write_bytes(out_dir / f"part-{shard:05d}.parquet", _parquet_bytes(table))
        written.append({"shard": shard, "rows": hi - lo, "path": path.as_uri()})
        ctx.log("infer_shard", shard=shard, rows=hi - lo)
    seconds = time.perf_counter() - began
    shards = sorted((s for per_rank in gather_objects(ctx, written) for s in per_rank), key=lambda s: s["shard"])
    if ctx.is_main:  # shards of an earlier, larger inference set would mix into this one's output
        for stale in out_dir.glob("part-*.parquet"):
            if int(stale.stem.removeprefix("part-")) >= n_shards:
                stale.unlink()
    total = sum(s["rows"] for s in shards)
    return {"output_url": icfg.output_url, "model_version": version, "rows": total, "shards": shards,
            "rows_per_s": round(total / seconds, 1) if seconds else 0.0, "compile": programs.compiler.summary()}
