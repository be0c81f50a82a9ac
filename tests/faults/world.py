"""What every case shares: a work folder, the dataset, a Prefect API, the fp32 reference and the
spec, whose outputs each case points at a folder (or bucket prefix) of its own."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from trnflow.specs import JobSpec, validate_spec
from trnflow.workload.synth import synthesize

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "jobspecs" / "examples" / "quickstart.yaml"
STEPS, EVERY = 40, 10  # a checkpoint every 10 steps: at most 10 steps may be redone


@dataclass
class World:
    root: Path
    reference: Path | None
    """The fp32 reference the gate compares with; None: the gate compares with the champion."""
    compile_cache: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    def layout(self, name: str) -> dict:
        """The sections of the fault-free run `name` (`ddp`, `fsdp`, `skip-25`: told to skip step 25's
        batch, or `tp`: a Llama-style decoder's layers split over the two cores, gated on perplexity
        against the champion), which a case compared with it runs too."""
        if name == "ddp":
            return {}
        if name == "fsdp":
            return {"train": {"parallelism": {"strategy": "fsdp"}}}
        if name == "skip-25":  # as a run that rolled back a divergence at step 25 ends; one batch fewer
            return {"train": {"skip_steps": [25]}, "gate": {"reference": None}}  # than the reference saw
        assert name == "tp", name
        return {"model": {"recipe": "hf-causal-lm", "params": {"pretrained": str(self.decoder()), "seq_len": 32,
                                                               "rows": "text"}},
                "gate": {"metric": "perplexity", "metrics": [], "reference": "champion"},
                "train": {"parallelism": {"strategy": "ddp", "tp": 2}}}

    def decoder(self) -> Path:
        """A tiny Llama-style decoder with a tokenizer learned from the world's training texts (once)."""
        import pyarrow.parquet as pq

        from tests.pretrained import tiny_causal_lm

        folder = self.root / "decoder"
        if not (folder / "config.json").is_file():
            texts = [str(t) for f in sorted((self.data / "train").rglob("*.parquet")) for t in pq.read_table(f)["text"]]
            tiny_causal_lm(folder, texts[:2000])
        return folder

    def spec(self, out: str, **sections) -> JobSpec:
        """The quickstart spec, shortened, writing under `out` (a folder, or an s3:// prefix)."""
        data = yaml.safe_load(QUICKSTART.read_text())
        base = {
            "data": {"train": str(self.data / "train"), "holdout": str(self.data / "holdout"),
                     "inference": str(self.data / "inference")},
            "compute": {"instance_type": "trn1.32xlarge", "cores_per_node": 2},  # spare cores to move to
            "compile": {"cache_url": str(self.compile_cache)},
            "train": {"steps": STEPS, "checkpoint_every": EVERY, "log_every": 1,
                      "checkpoint_url": f"{out}/checkpoints"},
            "retries": {"max_retries": 2, "backoff_seconds": 0},
            "gate": {"reference": str(self.reference) if self.reference else "champion", "eval_every": 20},
            "preflight": {"collective_timeout_seconds": 15},
            "inference": {"output_url": f"{out}/embeddings", "shard_size": 100},
            "registry_url": f"{out}/registry",
            "schedule": None,
        }
        for name, values in [*base.items(), *sections.items()]:
            data[name] = {**(data.get(name) or {}), **values} if isinstance(values, dict) else values
        return validate_spec(data)


def merged(first: dict, then: dict) -> dict:
    """`first` with `then`'s values over it, nested mappings merged key by key."""
    out = dict(first)
    for key, value in then.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@contextlib.contextmanager
def patched_env(values: dict[str, str]) -> Iterator[None]:
    """`os.environ` with `values` set, restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def world(root: Path, *, reference: bool = True, prefect: bool = True,
          compile_cache: Path | None = None) -> Iterator[World]:
    """Environment, data and (with `prefect`) a Prefect API of its own for the matrix; with
    `reference`, the gate's fp32 reference is trained once. The environment is restored after.
    `compile_cache` may be one that already holds the quickstart model's graphs."""
    from prefect.testing.utilities import prefect_test_harness

    from trnflow.backends.reference import run_reference

    root.mkdir(parents=True, exist_ok=True)
    env = {
        "TRNFLOW_HOME": str(root / "home"), "TRNFLOW_POLL_SECONDS": "0.2",
        "TRNFLOW_NEURON_RT_DIR": str(root / "neuron-rt"),  # the matrix's own emulated cores
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    with patched_env(env):
        if not (root / "data" / "holdout").is_dir():
            synthesize(root / "data", days=2, rows_per_day=600, seed=3, holdout_rows=400, inference_rows=350)
        w = World(root, root / "reference" / "metrics.json" if reference else None,
                  compile_cache or root / "compile-cache")
        with prefect_test_harness(server_startup_timeout=120) if prefect else contextlib.nullcontext():
            if w.reference and not w.reference.is_file():
                run_reference(w.spec(str(root / "reference-run")))
            yield w
