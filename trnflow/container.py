"""The training container's entrypoint: `python -m trnflow.container train|batch`.

It turns the service's contract into a torchrun rendezvous and runs the one workload program:
- SageMaker runs the image as `<entrypoint> train`. Hosts come from `SM_HOSTS`/`SM_CURRENT_HOST`
  (or /opt/ml/input/config/resourceconfig.json), the rendezvous from `SM_MASTER_ADDR`/`SM_MASTER_PORT`;
  the result goes to /opt/ml/output/data (uploaded as output.tar.gz), and a failure to
  /opt/ml/output/failure, which SageMaker reports as `AlgorithmError: <its text>`.
- Batch starts every node with the command `batch`. `AWS_BATCH_JOB_NODE_INDEX`,
  `AWS_BATCH_JOB_NUM_NODES` and `AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS` (absent on the main
  node itself) give the rendezvous. Batch has no output channel, so each node uploads its root
  failure, and the main node the result, under `TRNFLOW_RESULT_URL/<job id>/`.

The job's phase, run id, spec location and cores per node come from `TRNFLOW_*` variables set by
the request builders. A transient failure exits with 75, which Batch's retry strategy retries;
every attempt and resubmission resumes from the run's checkpoints, which live in the run's folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trnflow.backends.failures import name_first_rank, read_exits, read_reports, root_failure
from trnflow.backends.launcher import CONSOLE
from trnflow.errors import ExitCode, FatalError
from trnflow.neuron.launch import LAUNCHER, RANK_LOGS, WORKLOAD
from trnflow.results import FailureReport
from trnflow.storage import open_store

BATCH_MASTER_PORT = 41000
"""torchrun's rendezvous port between Batch nodes (the port the Neuron Batch samples use)."""
FAILURE_TEXT_LIMIT = 900
"""SageMaker keeps the first 1024 characters of the failure file as the job's FailureReason."""


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    output_dir: Path


def opt_ml(env: dict[str, str]) -> Path:
    """SageMaker's /opt/ml (`TRNFLOW_OPT_ML` moves it, as a bind mount would)."""
    return Path(env.get("TRNFLOW_OPT_ML", "/opt/ml"))


def sagemaker_rendezvous(env: dict[str, str]) -> Rendezvous:
    if "SM_HOSTS" in env:
        hosts, current = json.loads(env["SM_HOSTS"]), env.get("SM_CURRENT_HOST")
    else:
        config = json.loads((opt_ml(env) / "input" / "config" / "resourceconfig.json").read_text())
        hosts, current = config["hosts"], config["current_host"]
    hosts = sorted(hosts)
    current = current or hosts[0]
    return Rendezvous(
        nnodes=len(hosts),
        node_rank=hosts.index(current),
        master_addr=env.get("SM_MASTER_ADDR", hosts[0]),
        master_port=int(env.get("SM_MASTER_PORT", "7777")),
        output_dir=Path(env.get("SM_OUTPUT_DATA_DIR", opt_ml(env) / "output" / "data")),
    )


def batch_rendezvous(env: dict[str, str], own_address: str | None = None) -> Rendezvous:
    nodes = int(env.get("AWS_BATCH_JOB_NUM_NODES", "1"))
    rank = int(env.get("AWS_BATCH_JOB_NODE_INDEX", "0"))
    main = env.get("AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS")  # set on child nodes only
    if main is None and rank != int(env.get("AWS_BATCH_JOB_MAIN_NODE_INDEX", "0")):
        raise FatalError(f"Batch node {rank} has no AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS; is the job "
                         "definition of type multinode?")
    return Rendezvous(
        nnodes=nodes,
        node_rank=rank,
        master_addr=main or own_address or socket.gethostbyname(socket.gethostname()),
        master_port=int(env.get("TRNFLOW_MASTER_PORT", BATCH_MASTER_PORT)),
        output_dir=Path(env.get("TRNFLOW_OUTPUT_DIR", "/tmp/trnflow-output")),  # noqa: S108 (the container's own)
    )


def rank_folder(r: Rendezvous) -> Path:
    """Where the launcher records how this node's ranks ended (exits.json): beside the output, not
    in it (SageMaker uploads the output folder)."""
    return r.output_dir.parent / f"trnflow-{RANK_LOGS}"


def torchrun_argv(r: Rendezvous, env: dict[str, str], spec_file: Path) -> list[str]:
    """The torchrun command for this node, through trnflow's launcher: one process per NeuronCore of
    the instance, forked from it (see `trnflow.backends.launcher`), writing to the container's log stream."""
    argv = [sys.executable, "-m", LAUNCHER, CONSOLE, str(rank_folder(r)), "--nnodes", str(r.nnodes),
            "--nproc-per-node", env["TRNFLOW_NPROC_PER_NODE"], "--node-rank", str(r.node_rank),
            "--master-addr", r.master_addr, "--master-port", str(r.master_port),
            "-m", WORKLOAD, env["TRNFLOW_PHASE"], "--spec", str(spec_file),
            "--run-id", env["TRNFLOW_RUN_ID"], "--output", str(r.output_dir)]
    if env.get("TRNFLOW_CHECKPOINT"):
        argv += ["--checkpoint", env["TRNFLOW_CHECKPOINT"]]
    return argv


def _fetch_spec(env: dict[str, str], into: Path) -> Path:
    """The spec from SageMaker's `spec` channel when there is one, else from TRNFLOW_SPEC_URL."""
    channel = Path(env.get("SM_CHANNEL_SPEC", opt_ml(env) / "input" / "data" / "spec"))
    if (channel / "spec.json").is_file():
        return channel / "spec.json"

    base, _, name = env["TRNFLOW_SPEC_URL"].rpartition("/")
    into.mkdir(parents=True, exist_ok=True)
    target = into / "spec.json"
    target.write_bytes(open_store(base).read(name))
    return target


def _report(env: dict[str, str], service: str, r: Rendezvous, failure: FailureReport | None) -> None:
    """Leave the node's outcome where the service's caller finds it."""
    if service == "sagemaker" and failure is not None:
        path = opt_ml(env) / "output" / "failure"
        path.parent.mkdir(parents=True, exist_ok=True)
        brief = failure.model_copy(update={"message": failure.message[:FAILURE_TEXT_LIMIT // 2]})
        text = brief.model_dump_json(include={"type", "retryable", "bad_cores", "ranks", "message"})
        path.write_text(text[:FAILURE_TEXT_LIMIT])
    if not env.get("TRNFLOW_RESULT_URL"):
        return
    # Every node's failure is uploaded at once, on both services: the backend stops a job whose
    # other node failed while the main node goes on (`backends.cloud.failed_node`).
    job_id = (env.get("TRAINING_JOB_NAME") if service == "sagemaker" else
              env.get("AWS_BATCH_JOB_ID", "job").split("#")[0]) or "job"
    store = open_store(f"{env['TRNFLOW_RESULT_URL'].rstrip('/')}/{job_id}")
    if failure is not None:
        store.write(f"failure-node{r.node_rank}.json", failure.model_dump_json(exclude_none=True).encode())
    elif service == "batch" and r.node_rank == 0 and (r.output_dir / "result.json").is_file():
        store.write("result.json", (r.output_dir / "result.json").read_bytes())


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    modes = {"train": "sagemaker", "sagemaker": "sagemaker", "batch": "batch"}
    if not args or args[0] not in modes:
        print("usage: python -m trnflow.container train|batch  (SageMaker runs the image with `train`)",
              file=sys.stderr)
        return ExitCode.BAD_INPUT
    service = modes[args[0]]
    env = dict(os.environ)
    r = sagemaker_rendezvous(env) if service == "sagemaker" else batch_rendezvous(env)
    spec_file = _fetch_spec(env, r.output_dir.parent / "trnflow-input")
    launcher = subprocess.Popen(torchrun_argv(r, env, spec_file))
    # The service stops a container (a spot reclaim notice, a stopped job) with SIGTERM to its first
    # process, this one: the launcher passes it on to every rank, and training checkpoints before it ends.
    signal.signal(signal.SIGTERM, lambda signum, frame: launcher.send_signal(signal.SIGTERM))
    code = launcher.wait()
    failure = None
    if code:
        nproc = int(env["TRNFLOW_NPROC_PER_NODE"])
        exits = read_exits(rank_folder(r))
        failure = name_first_rank(root_failure(read_reports(r.output_dir), nproc, first_rank=r.node_rank * nproc,
                                               exits=exits), exits)
    _report(env, service, r, failure)
    if failure is not None and failure.retryable:
        return ExitCode.TRANSIENT
    return code


if __name__ == "__main__":
    sys.exit(main())
