"""Where a training run starts: its own newest checkpoint (a retry resumes), else `train.init_from`
(incremental training), else scratch; and which data it reads.

A resumed run reads exactly the files it started on, even if new partitions have arrived since, so
the resume is exact. A new run with `data.window: since-watermark` reads only the partitions after
the watermark of the checkpoint it starts from; if there are none, it has nothing to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from trnflow.errors import DataError
from trnflow.lifecycle.registry import Registry
from trnflow.specs import JobSpec
from trnflow.storage import join
from trnflow.storage.datafiles import DataFile, data_files, partitions, since_watermark
from trnflow.workload.checkpoint import Checkpoint, RunCheckpoints, load_checked
from trnflow.workload.context import WorkerContext, gather_objects

LINEAGE_DEPTH = 20


@dataclass
class Start:
    checkpoints: RunCheckpoints
    resumed: Checkpoint | None
    """This run's own newest good checkpoint, when a retry resumes."""
    init: Checkpoint | None
    """`train.init_from`, when a new run starts from it."""
    files: list[DataFile]
    """The training files this run reads; empty when there is no new data."""
    watermark: str | None
    """The newest partition this run has consumed (the parent's when it reads none)."""

    @property
    def source(self) -> Checkpoint | None:
        return self.resumed or self.init

    def lineage(self) -> dict:
        """The run's parent checkpoint, its ancestors (nearest first) and the global step it starts at."""
        if self.resumed and self.resumed.meta:
            meta = self.resumed.meta
            return {"parent": meta.parent, "lineage": meta.lineage, "base_step": meta.base_step}
        if self.init:  # a plain state_dict file starts a lineage of its own
            ancestors = self.init.meta.lineage if self.init.meta else []
            base = (self.init.meta.base_step if self.init.meta else 0) + self.init.step
            return {"parent": self.init.url, "lineage": [self.init.url, *ancestors][:LINEAGE_DEPTH], "base_step": base}
        return {"parent": None, "lineage": [], "base_step": 0}


def _init_from(ctx: WorkerContext, featurizer_file: str) -> Checkpoint | None:
    spec: JobSpec = ctx.spec
    source = spec.train.init_from
    if source == "champion":  # looked up once, by rank 0: a promotion meanwhile must not split the ranks
        assert spec.registry_url is not None  # the spec checks it
        champion = Registry(spec.registry_url).champion(spec.name) if ctx.is_main else None
        if ctx.is_main:
            if champion is None:
                ctx.log("init", checkpoint=None, message=f"{spec.name} has no champion in {spec.registry_url} yet: "
                        "starting from scratch")
            else:
                ctx.log("champion", version=champion.version, checkpoint=champion.checkpoint)
        source = gather_objects(ctx, champion.checkpoint if champion else None)[0]
    return load_checked(ctx, source, featurizer_file) if source else None  # the champion: as registered


def find_start(ctx: WorkerContext, run_id: str, featurizer_file: str) -> Start:
    """`featurizer_file`: the recipe's, which every checkpoint the run starts from must hold."""
    spec: JobSpec = ctx.spec
    checkpoints = RunCheckpoints(join(spec.train.checkpoint_url, run_id), featurizer_file=featurizer_file)
    resumed = checkpoints.latest(on_skip=lambda url, why: ctx.log("checkpoint_skipped", url=url, reason=why))
    files = data_files(spec.data.train, spec.data.format, spec.data.ready_marker)
    if resumed and resumed.meta:  # a run's own checkpoints always have their meta.json
        wanted = resumed.meta.data.files
        by_name = {f.name: f for f in files}
        gone = [n for n in wanted if n not in by_name]
        if gone:
            raise DataError(f"{spec.data.train}: {gone[0]} (read by this run before it stopped) is gone, so the run "
                            "cannot resume exactly; restore the file or start a new run")
        chosen = [by_name[n] for n in wanted]
        return Start(checkpoints, resumed, None, chosen, resumed.meta.data.watermark)
    init = _init_from(ctx, featurizer_file)
    parent_mark = init.watermark if init else None
    if spec.data.window == "since-watermark":
        files = since_watermark(files, parent_mark, spec.data.train)
    watermark = max([parent_mark or "", *partitions(files)]) or None
    return Start(checkpoints, None, init, files, watermark)
