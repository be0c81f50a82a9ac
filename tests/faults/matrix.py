"""Running the cases and reporting them: each case's run is compared with the fault-free one."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tests.faults.cases import CASES, HOST_LOST, Case, Run, can_mount, disk_full
from tests.faults.outcome import Snapshot, events_in_task_logs, local_train_logs, prefect_runs, steps_redone
from tests.faults.world import EVERY, STEPS, World, merged, patched_env
from trnflow.specs import validate_spec
from trnflow.testing import s3faults

BASELINE = "baseline.json"
"""In a fault-free run's folder: its spec and final checkpoint."""
COLUMNS = ("case", "fault struck", "recovered", "retries", "steps redone", "weights", "registry", "outputs",
           "nothing lost")


class Matrix:
    def __init__(self, world: World):
        self.world = world
        self.baselines: dict[str, Snapshot] = {}
        """The fault-free runs by layout (`ddp`, `fsdp`, `tp`: `World.layout`): each case is compared
        with its own."""
        self._stack = contextlib.ExitStack()
        self._moto: str | None = None

    def __enter__(self) -> Matrix:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # -- AWS, started only for the cases that need it --

    def moto(self) -> str:
        if self._moto is None:
            import logging
            import socket

            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.WARNING)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            server.start()
            self._stack.callback(server.stop)
            self._moto = f"http://127.0.0.1:{port}"
        return self._moto

    def _aws_env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.moto(), "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    @contextlib.contextmanager
    def _storage(self, case: Case, run: Run) -> Iterator[None]:
        """Where the case writes: its folder, a bucket with S3 faults injected, or a cloud service."""
        if case.storage == "local":
            yield
            return
        import boto3

        with patched_env(self._aws_env()):
            if case.storage.startswith("s3-"):
                bucket = f"faults-{case.name}"
                boto3.client("s3").create_bucket(Bucket=bucket)
                run.out = f"s3://{bucket}/{case.name}"
                injected = run.folder / "s3-injected.log"
                s3faults.activate()  # this process's clients; the environment reaches the workers'
                with patched_env(s3faults.environment(case.storage.removeprefix("s3-"), str(injected))):
                    yield
                return
            with self._cloud(case, run):
                yield

    @contextlib.contextmanager
    def _cloud(self, case: Case, run: Run) -> Iterator[None]:
        import boto3

        from trnflow.testing.mockcloud import MockCloud, ServiceFault
        from trnflow.testing.mockcloud.provision import SETTINGS, provision

        fault = (ServiceFault("sagemaker", "train", "InternalServerError: We encountered an internal error.",
                              when="checkpoint") if case.storage == "sagemaker" else
                 ServiceFault("batch", "train", HOST_LOST, when="checkpoint"))
        if case.fault == "spot":
            fault = ServiceFault(case.storage, "train", "spot capacity reclaimed", when="checkpoint", spot=True)
        faults = [] if case.node_faults or case.no_capacity or case.host_faults else [fault]
        with MockCloud(self.moto(), run.folder / "cloud", faults=faults, node_faults=case.node_faults,
                       no_capacity=case.no_capacity, host_faults=case.host_faults) as cloud:
            run.bad_hosts = cloud.bad_hosts  # filled as the faults find their instances
            outputs = provision(cloud.client, prefix=f"f{case.storage[:2]}")
            bucket = outputs["DATA_BUCKET"]
            s3 = boto3.client("s3")
            for path in sorted(self.world.data.rglob("*")):
                if path.is_file():
                    s3.upload_file(str(path), bucket, f"reviews/{path.relative_to(self.world.data)}")
            if self.world.reference is not None:  # else the gate compares with the champion
                s3.upload_file(str(self.world.reference), bucket, "reference/metrics.json")
            compute = {"backend": case.storage, "instance_type": "trn1.2xlarge", "nodes": 1, "cores_per_node": 2}
            if case.storage == "batch":  # two nodes of one core: the same two ranks as the baseline
                compute = {"backend": "batch", "instance_type": "trn1.32xlarge", "nodes": 2, "cores_per_node": 1,
                           "share_identifier": "default", "fair_share": True}
            run.out = f"s3://{bucket}/{case.name}"
            run.sections.update(
                compute=compute | case.sections.get("compute", {}),
                data={part: f"s3://{bucket}/reviews/{part}" for part in ("train", "holdout", "inference")},
                compile={"cache_url": f"s3://{bucket}/neuron-cache"},
                gate={"reference": f"s3://{bucket}/reference/metrics.json" if self.world.reference else "champion"})
            names = {f"TRNFLOW_{k}": outputs[k] for k in SETTINGS}
            with patched_env(names):
                yield

    # -- the runs --

    def run_baseline(self, layout: str = "ddp") -> float:
        """The fault-free run of a layout (`World.layout`); how long it took."""
        began = time.monotonic()
        name = "baseline" if layout == "ddp" else f"baseline-{layout}"
        folder = self.world.root / name
        shutil.rmtree(folder, ignore_errors=True)
        run = Run(self.world, folder, str(folder), self.world.layout(layout), name)
        state = run.flow()
        if not state.is_completed():
            raise RuntimeError(f"the fault-free {layout} run failed: {state.result(raise_on_failure=False)}")
        checkpoint = state.result().results["train"].checkpoint
        self.baselines[layout] = Snapshot.of(run.spec, checkpoint)
        record = {"spec": run.spec.model_dump(mode="json"), "checkpoint": checkpoint}
        (folder / BASELINE).write_text(json.dumps(record))  # for `load_baseline`, in another world
        return time.monotonic() - began

    def load_baseline(self, folder: Path, layout: str = "ddp") -> None:
        """The fault-free run of `layout` that `run_baseline` made into `folder`, in another world (the
        same data and spec, other folders), to compare this world's cases with."""
        record = json.loads((folder / BASELINE).read_text())
        self.baselines[layout] = Snapshot.of(validate_spec(record["spec"]), record["checkpoint"])

    def run_case(self, case: Case) -> dict[str, Any]:
        if case.baseline not in self.baselines:  # the fault-free run of the case's layout, once
            self.run_baseline(case.baseline)
        row: dict[str, Any] = {"case": case.name, "what": case.what, "max_redone": EVERY * case.interruptions,
                               **({"rtol": case.rtol} if case.rtol else {}),
                               **({"outputs_rtol": case.outputs_rtol} if case.outputs_rtol else {})}
        if case.setup is disk_full and not can_mount():
            return {**row, "recovered": None, "skipped": "needs root to mount a size-limited tmpfs"}
        folder = self.world.root / "cases" / case.name
        shutil.rmtree(folder, ignore_errors=True)  # a rerun of the matrix starts each case afresh
        folder.mkdir(parents=True)
        run = Run(self.world, folder, str(folder), merged(self.world.layout(case.baseline), case.sections),
                  f"fault-{case.name}")
        shutil.rmtree(self._home() / "runs" / run.run_id, ignore_errors=True)  # and the cores it found bad
        since, began = datetime.now(UTC), time.time()
        try:
            return self._run(case, run, row, since, began)
        except Exception as exc:  # the rehearsal itself went wrong: report it as not recovered
            return {**row, "recovered": False, "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "seconds": round(time.time() - began, 1)}

    def _run(self, case: Case, run: Run, row: dict[str, Any], since: datetime, began: float) -> dict[str, Any]:
        with self._storage(case, run), case.setup(run) if case.setup else contextlib.nullcontext(), \
                events_in_task_logs():
            state = run.flow()
            recovered = state.is_completed()
            row["state"] = state.name
            if not recovered:
                row["error"] = str(state.result(raise_on_failure=False))[:2000]
                return {**row, "recovered": False, "seconds": round(time.time() - began, 1)}
            injected = run.folder / "s3-injected.log"  # counted before the snapshot's own reads add to it
            api = len(injected.read_text().splitlines()) if injected.exists() else 0
            snapshot = Snapshot.of(run.spec, state.result().results["train"].checkpoint)
        retries, relayed = prefect_runs(since)
        logs = relayed if case.storage in ("sagemaker", "batch") else local_train_logs(self._jobs_dir(), began)
        redone, attempts = steps_redone(logs, STEPS)
        by = {f"task:{name}": n for name, n in sorted(retries.items())}
        results = state.result().results
        rollbacks = len(results["train"].rollbacks)  # each resumes within its attempt
        if rollbacks:
            by["rollback"] = rollbacks
        service = attempts - 1 - retries.get("train", 0) - run.reruns - rollbacks
        if service > 0:
            by["service"] = service
        if run.reruns:
            by["flow rerun"] = run.reruns
        if api:
            by["api"] = api
        same = snapshot.differences(self.baselines[case.baseline], case.rtol, case.outputs_rtol)
        row |= {"recovered": True, "retries": sum(by.values()), "retries_by": by, "steps_redone": redone,
                "training_attempts": attempts, "train_cores": results["train"].cores,
                "train_instance": results["train"].ran_on.instance_type if results["train"].ran_on else None,
                "train_hosts": results["train"].ran_on.hosts if results["train"].ran_on else [],
                "bad_hosts": sorted(run.bad_hosts),
                "compiled": results["compile"].compiled, **same,
                "nothing_lost": same["checkpoints"] and same["outputs"], "seconds": round(time.time() - began, 1)}
        row["fault_seen"] = case.seen(row) if case.seen else attempts >= 1 + case.interruptions
        return row

    @staticmethod
    def _home() -> Path:
        from trnflow.settings import TrnflowSettings

        return TrnflowSettings().home.expanduser().resolve()

    @staticmethod
    def _jobs_dir() -> Path:
        from trnflow.settings import TrnflowSettings

        return TrnflowSettings().jobs_dir



def passed(row: dict[str, Any]) -> bool:
    """Recovered, with at most one checkpoint interval redone per interruption, and everything equal
    (or skipped, saying why)."""
    if row.get("skipped"):
        return True
    return bool(row.get("recovered")) and row.get("steps_redone", EVERY + 1) <= row["max_redone"] and all(
        row.get(k) for k in ("fault_seen", "weights", "registry", "outputs", "nothing_lost"))


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    def mark(value: Any, within: str = "") -> str:
        return {True: f"yes{within}", False: "NO", None: "-"}.get(value, str(value))

    out = []
    for r in rows:
        within = f" ({r['rtol']:g})" if r.get("rtol") else ""
        if r.get("skipped"):
            out.append([r["case"], f"skipped: {r['skipped']}", *["-"] * (len(COLUMNS) - 2)])
            continue
        by = ", ".join(f"{k} {v}" for k, v in r.get("retries_by", {}).items())
        out.append([r["case"], mark(r.get("fault_seen")), mark(r["recovered"]),
                    f"{r.get('retries', '-')}" + (f" ({by})" if by else ""),
                    str(r.get("steps_redone", "-")),
                    mark(r.get("weights"), f", by outputs{within}" if within else ""), mark(r.get("registry"), within),
                    mark(r.get("outputs"), f" ({r['outputs_rtol']:g})" if r.get("outputs_rtol") else within),
                    mark(r.get("nothing_lost"))])
    return out


__all__ = ["CASES", "COLUMNS", "Matrix", "World", "passed", "table_rows"]
