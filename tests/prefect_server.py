"""A real `prefect server` on 127.0.0.1 for the integration tests (its own home and SQLite
database), `trnflow serve` against it, and a client of it whatever API the test process uses."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from trnflow.testing.mockcloud.nodes import free_port

TRNFLOW = str(Path(sys.executable).with_name("trnflow"))
PREFECT = str(Path(sys.executable).with_name("prefect"))


def small_spec(root: Path, dataset: Path, compile_cache: Path, name: str, schedule: dict[str, str]) -> Path:
    """The quickstart on one core and 20 steps, reading `dataset`, writing under `root`, on
    `schedule`: written as `root/<name>.yaml`, whose path is returned."""
    examples = Path(__file__).resolve().parents[1] / "jobspecs" / "examples"
    spec = yaml.safe_load((examples / "quickstart.yaml").read_text())
    spec.update(
        name=name,
        data={"train": str(dataset / "train"), "holdout": str(dataset / "holdout"),
              "inference": str(dataset / "inference"), "format": "jsonl"},
        compute={**spec["compute"], "cores_per_node": 1},  # one rank a job: these tests are about serving
        train={**spec["train"], "steps": 20, "checkpoint_every": 10, "log_every": 10, "global_batch_size": 16,
               "checkpoint_url": str(root / "checkpoints")},
        compile={**spec["compile"], "cache_url": str(compile_cache)},
        gate={"reference": None, "eval_every": 10},
        inference={**spec["inference"], "output_url": str(root / "embeddings"), "shard_size": 200},
        registry_url=str(root / "registry"),
        schedule=schedule,
    )
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def wait_for(check: Callable[[], Any], seconds: float, what: str, every: float = 0.5) -> Any:
    """`check()`'s first true answer, polled every `every` seconds; AssertionError after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"gave up waiting for {what}")


@contextlib.contextmanager
def prefect_server(home: Path, **settings: str) -> Iterator[dict[str, str]]:
    """`trnflow server` (`prefect server start`, its scheduler and other services included, its UI
    pointed at its own port) until the block ends; yields the environment that points a client at
    it, with the server's process id as `SERVER_PID`. `settings` are extra variables for both."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}, "PREFECT_HOME": str(home),
           "PREFECT_API_URL": api, "PREFECT_UI_URL": f"http://127.0.0.1:{port}", **settings}
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen([TRNFLOW, "server", "--port", str(port)],
                                env={**env, "PREFECT_LOGGING_LEVEL": "WARNING"},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{api}/health", timeout=2) as answer:  # noqa: S310 (loopback)
                    return answer.status == 200
            except OSError:
                assert proc.poll() is None, (home / "server.log").read_text()
                return False

        try:
            wait_for(healthy, 120, "the Prefect server")
            yield {**env, "SERVER_PID": str(proc.pid)}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


@contextlib.contextmanager
def serving(env: dict[str, str], specs: list[Path], cwd: Path, log: Path) -> Iterator[subprocess.Popen]:
    """`trnflow serve SPECS...` from its own process (and session) until the block ends."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([TRNFLOW, "serve", *map(str, specs)], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # nothing of it is needed any more
            proc.wait(timeout=30)


@contextlib.contextmanager
def client_of(env: dict[str, str]) -> Iterator[Any]:
    """A Prefect client of the test server, whatever API this process otherwise uses."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}), get_client(sync_client=True) as client:
        yield client


def deployments(env: dict[str, str]) -> dict[str, Any]:
    """The server's deployments by `flow/deployment` name."""
    with client_of(env) as client:
        flows = {f.id: f.name for f in client.read_flows()}
        return {f"{flows[d.flow_id]}/{d.name}": d for d in client.read_deployments()}


def flow_runs(env: dict[str, str], deployment_id: Any) -> list[Any]:
    """Every flow run of one deployment, by expected start."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with client_of(env) as client:
        return client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
                                     sort=FlowRunSort.EXPECTED_START_TIME_ASC)


def main(argv: list[str]) -> int:
    """`python -m tests.prefect_server -- COMMAND...`: COMMAND run with a Prefect server of its own,
    its API in TRNFLOW_TEST_PREFECT_API_URL. The XLA lane runs at nice 19 beside the other tests;
    a server started inside it starved for minutes before answering (Prefect's harness gives up
    after its timeout), so `make test` starts the lane's server here, at the usual priority."""
    import tempfile

    if argv[:1] != ["--"] or len(argv) < 2:
        print("usage: python -m tests.prefect_server -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="prefect-home-") as home, prefect_server(Path(home)) as env:
        done = subprocess.run(argv[1:], env={**os.environ, "TRNFLOW_TEST_PREFECT_API_URL": env["PREFECT_API_URL"]},
                              check=False)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
