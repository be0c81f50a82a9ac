"""The training container's entrypoint: `python -m trnflow.container sagemaker|batch`.

It turns the service's contract into a torchrun rendezvous and runs the one workload program:
- SageMaker: `SM_HOSTS`, `SM_CURRENT_HOST` and `SM_MASTER_ADDR`/`SM_MASTER_PORT`; results in
  `SM_OUTPUT_DATA_DIR`, failures in `/opt/ml/output/failure`; the run's checkpoints arrive
  in /opt/ml/checkpoints from `CheckpointConfig.S3Uri`;
- Batch: `AWS_BATCH_JOB_NODE_INDEX`, `AWS_BATCH_JOB_NUM_NODES`, and
  `AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS`, which is absent on the main node itself.

The job's phase, run id, spec location and cores per node come from `TRNFLOW_*` variables set
by the request builders. A transient failure exits with 75, which Batch's retry strategy retries;
the retry resumes from the run's checkpoints, because they live in the run's own folder.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from trnflow.errors import FatalError
from trnflow.failures import read_reports, root_failure

TRANSIENT_EXIT_CODE = 75
"""The exit code after a transient failure (a lost core, a timeout): Batch's retry strategy
retries it, and the next attempt resumes from the run's checkpoint."""
BATCH_MASTER_PORT = 41000
"""torchrun's rendezvous port between Batch nodes (the port the Neuron Batch samples use)."""


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    output_dir: Path


def sagemaker_rendezvous(env: dict[str, str]) -> Rendezvous:
    hosts = sorted(json.loads(env.get("SM_HOSTS", '["algo-1"]')))
    current = env.get("SM_CURRENT_HOST", hosts[0])
    return Rendezvous(
        nnodes=len(hosts),
        node_rank=hosts.index(current),
        master_addr=env.get("SM_MASTER_ADDR", hosts[0]),
        master_port=int(env.get("SM_MASTER_PORT", "7777")),
        output_dir=Path(env.get("SM_OUTPUT_DATA_DIR", "/opt/ml/output/data")),
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
        master_port=BATCH_MASTER_PORT,
        output_dir=Path(env.get("TRNFLOW_OUTPUT_DIR", "/tmp/trnflow-output")),  # noqa: S108 (the container's own)
    )


def torchrun_argv(r: Rendezvous, env: dict[str, str], spec_file: Path) -> list[str]:
    """The torchrun command for this node: one process per NeuronCore of the instance."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(r.nnodes),
            "--nproc-per-node", env["TRNFLOW_NPROC_PER_NODE"], "--node-rank", str(r.node_rank),
            "--master-addr", r.master_addr, "--master-port", str(r.master_port),
            "-m", "trnflow.workload", env["TRNFLOW_PHASE"], "--spec", str(spec_file),
            "--run-id", env["TRNFLOW_RUN_ID"], "--output", str(r.output_dir)]
    if env.get("TRNFLOW_CHECKPOINT"):
        argv += ["--checkpoint", env["TRNFLOW_CHECKPOINT"]]
    return argv


def _fetch_spec(env: dict[str, str], into: Path) -> Path:
    """The spec from SageMaker's `spec` channel when there is one, else from TRNFLOW_SPEC_URL."""
    channel = env.get("SM_CHANNEL_SPEC")
    if channel and (Path(channel) / "spec.json").is_file():
        return Path(channel) / "spec.json"
    from trnflow.storage import open_store

    base, _, name = env["TRNFLOW_SPEC_URL"].rpartition("/")
    into.mkdir(parents=True, exist_ok=True)
    target = into / "spec.json"
    target.write_bytes(open_store(base).read(name))
    return target


def _transient(output_dir: Path, processes: int) -> bool:
    """Whether the job's root failure is one a retry can help."""
    return bool(root_failure(read_reports(output_dir), processes).get("retryable"))


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if not args or args[0] not in ("sagemaker", "batch"):
        print("usage: python -m trnflow.container sagemaker|batch", file=sys.stderr)
        return 2
    env = dict(os.environ)
    r = sagemaker_rendezvous(env) if args[0] == "sagemaker" else batch_rendezvous(env)
    spec_file = _fetch_spec(env, r.output_dir.parent / "trnflow-input")
    code = subprocess.call(torchrun_argv(r, env, spec_file))
    if code and _transient(r.output_dir, int(env["TRNFLOW_NPROC_PER_NODE"])):
        return TRANSIENT_EXIT_CODE
    return code


if __name__ == "__main__":
    sys.exit(main())
