"""The training container's entrypoint: `python -m trnflow.backends.container train|batch`.

It turns the service's contract into a torchrun rendezvous and runs the one workload program:
- SageMaker runs the image as `<entrypoint> train`. Hosts come from `SM_HOSTS`/`SM_CURRENT_HOST`
  (or /opt/ml/input/config/resourceconfig.json), the rendezvous from `SM_MASTER_ADDR`/`SM_MASTER_PORT`;
  the result goes to /opt/ml/output/data (uploaded as output.tar.gz), and a failure to
  /opt/ml/output/failure, which SageMaker reports as `AlgorithmError: <its text>`.
- Batch starts every node with the command `batch`. `AWS_BATCH_JOB_NODE_INDEX`,
  `AWS_BATCH_JOB_NUM_NODES` and `AWS_BATCH_JOB_MAIN_NODE_PRIVATE_IPV4_ADDRESS` (absent on the main
  node itself) give the rendezvous; a single-node job (a spot spec's) has none of them, and is node
  0 of 1. There the spot reclaim notice is read from the instance metadata service. Batch has no
  output channel, so each node uploads its root failure, and the main node the result, under
  `TRNFLOW_RESULT_URL/<job id>/`.

The job's phase, run id, spec location and cores per node come from `TRNFLOW_*` variables set by
the request builders. A transient failure exits with 75, which Batch's retry strategy retries;
every attempt and resubmission resumes from the run's checkpoints, which live in the run's folder.

A job may run several phases on the same instances (`TRNFLOW_PHASE=sanity+train`: the preflight
checks the very hosts that then train). Each node of every job uploads who it is
(`hosts/attempt<a>/node<r>.json`: the EC2 instance id where the metadata service answers), the
main node uploads each phase's result as it ends (`phases/<phase>.json`, only once it passed), and
before every later phase the nodes wait for the orchestrator's word (`proceed-<phase>.json`). A
preflight that finds a bad core, a node that hangs, or a collective that fails ends the job before
the next phase with `BadHost`, naming the instances at fault (exit code 79, which Batch's retry
strategy retries once trnflow has terminated them; SageMaker's job is submitted again): a node that
failed preflight never trains.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from trnflow.aws import RECLAIM_NOTICE_ENV, InstanceMetadata
from trnflow.backends.cloud import identity_name, node_identities
from trnflow.backends.contract import JobEnv, JobOutputs
from trnflow.backends.failures import name_first_rank, read_exits, read_reports, root_failure
from trnflow.backends.forked import run_as_program
from trnflow.backends.launcher import CONSOLE
from trnflow.backends.launcher import main as torchrun
from trnflow.errors import ExitCode, FatalError
from trnflow.neuron.launch import (
    INSTANCE_CORES_ENV,
    LAUNCHER,
    RANK_LOGS,
    WORKLOAD,
    aligned_ranges,
    budget_args,
    visible_cores_value,
)
from trnflow.records import RecordError, read
from trnflow.results import (
    RESULTS,
    FailureReport,
    NodeIdentity,
    Placement,
    Proceed,
    SanityResult,
    SlowRank,
    SlowRanks,
    StageResult,
)
from trnflow.specs import JobSpec, instance
from trnflow.storage import Store, open_store

FAILURE_TEXT_LIMIT = 900
"""SageMaker keeps the first 1024 characters of the failure file as the job's FailureReason."""
PROCEED_POLL_SECONDS = 2.0
"""How often nodes waiting between phases look for the orchestrator's word."""


@dataclass(frozen=True)
class Rendezvous:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    output_dir: Path


def opt_ml(env: dict[str, str]) -> Path:
    """SageMaker's /opt/ml (`TRNFLOW_OPT_ML` moves it, as a bind mount would)."""
    return JobEnv.one(env, "opt_ml")


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
        master_port=JobEnv.one(env, "master_port"),
        output_dir=JobEnv.one(env, "output_dir"),
    )


def rank_folder(r: Rendezvous) -> Path:
    """Where the launcher records how this node's ranks ended (exits.json): beside the output, not
    in it (SageMaker uploads the output folder)."""
    return r.output_dir.parent / f"trnflow-{RANK_LOGS}"


def torchrun_argv(r: Rendezvous, env: dict[str, str], spec_file: Path) -> list[str]:
    """The torchrun command for this node, through trnflow's launcher: one process per NeuronCore of
    the instance, forked from it (see `trnflow.backends.launcher`), writing to the container's log stream."""
    job = JobEnv.from_env(env)
    argv = [sys.executable, "-m", LAUNCHER, CONSOLE, str(rank_folder(r)), "--nnodes", str(r.nnodes),
            "--nproc-per-node", str(job.nproc_per_node), "--node-rank", str(r.node_rank),
            "--master-addr", r.master_addr, "--master-port", str(r.master_port),
            "-m", WORKLOAD, job.phase, "--spec", str(spec_file),
            "--run-id", job.run_id, "--output", str(r.output_dir)]
    if job.checkpoint:
        argv += ["--checkpoint", job.checkpoint]
    return argv + budget_args(job.budget_usd)


def _fetch_spec(env: dict[str, str], into: Path) -> Path:
    """The spec from SageMaker's `spec` channel when there is one, else from TRNFLOW_SPEC_URL."""
    channel = Path(env.get("SM_CHANNEL_SPEC", opt_ml(env) / "input" / "data" / "spec"))
    if (channel / "spec.json").is_file():
        return channel / "spec.json"

    url = JobEnv.from_env(env).spec_url
    if not url:
        raise FatalError(f"no spec: neither SageMaker's spec channel nor {JobEnv.var('spec_url')}")
    base, _, name = url.rpartition("/")
    into.mkdir(parents=True, exist_ok=True)
    target = into / "spec.json"
    target.write_bytes(open_store(base).read(name))
    return target


def instance_metadata(env: dict[str, str], timeout: float = 1.0) -> dict[str, str]:
    """This instance's id and type from the EC2 metadata service; {} where it does not answer
    (SageMaker's containers cannot reach it)."""
    imds = InstanceMetadata(env, timeout)
    found = {key: imds.get(key) for key in ("instance-id", "instance-type")}
    return {k: v for k, v in found.items() if v is not None}


def identity(env: dict[str, str], service: str, r: Rendezvous) -> NodeIdentity:
    """Who this node is in this attempt: its host name, and its EC2 instance where the metadata
    service says: a single-node Batch job's, which shares its host's network. A multi-node job's
    containers (awsvpc) are kept from the metadata service (ECS_AWSVPC_BLOCK_IMDS), and SageMaker's
    cannot reach it: the orchestrator asks the services where those ran."""
    awsvpc = "AWS_BATCH_JOB_NODE_INDEX" in env
    meta = instance_metadata(env) if service == "batch" and not awsvpc else {}
    host = env.get("SM_CURRENT_HOST") if service == "sagemaker" else None
    attempt = int(env.get("AWS_BATCH_JOB_ATTEMPT", "1")) if service == "batch" else 1
    return NodeIdentity(node=r.node_rank, attempt=attempt, host=host or socket.gethostname(),
                        instance_id=meta.get("instance-id"), instance_type=meta.get("instance-type"),
                        started_at=time.time())


def job_outputs(env: dict[str, str], service: str) -> Store | None:
    """Where this job's nodes leave what the orchestrator reads while and after it runs."""
    result_url = JobEnv.one(env, "result_url")  # alone: a failure is reported even where the rest is missing
    if not result_url:
        return None
    job_id = (env.get("TRAINING_JOB_NAME") if service == "sagemaker" else
              env.get("AWS_BATCH_JOB_ID", "job").split("#")[0]) or "job"
    return open_store(f"{result_url.rstrip('/')}/{job_id}")


def _named(nodes: list[int], identities: dict[int, NodeIdentity]) -> str:
    """`node 1 (i-0abc...)`, ... for the nodes given, with their instances where known."""
    return ", ".join(f"node {n} ({identities[n].label})" if n in identities else f"node {n}" for n in nodes)


def bad_host(why: str, nodes: list[int], identities: dict[int, NodeIdentity],
             bad_cores: list[int] | None = None) -> FailureReport:
    """The failure that has the job's hosts replaced (`BadHost`): `why`, the nodes at fault and the
    instances to replace."""
    instances = [identities[n].label for n in nodes if n in identities]
    return FailureReport(type="BadHost", retryable=True, bad_cores=sorted(bad_cores or []), instances=instances,
                         nodes=sorted(nodes),
                         message=f"preflight: {why}; the job ends before training, and {_named(nodes, identities)} "
                                 "is replaced before the preflight runs again")


def with_suspects(failure: FailureReport, slow: list[SlowRank], per_node: int,
                  identities: dict[int, NodeIdentity] | None = None) -> FailureReport:
    """A failure a retry can help with, naming the nodes whose ranks training's pace found at fault
    (`nodes`), for the orchestrator to replace their instances before the next attempt as it does a
    preflight's bad host's: the ranks a stalled rank was waiting for (`Stalled`'s `ranks`) and the
    ranks named slow (`slow`). Ranks are numbered node by node, `per_node` to a node."""
    if failure.type == "BadHost" or not failure.retryable:
        return failure
    why: dict[int, list[str]] = {}
    for rank in failure.ranks if failure.type == "Stalled" else []:
        why.setdefault(rank // per_node, []).append(f"rank {rank} held the step up")
    for s in slow:
        why.setdefault(s.rank // per_node, []).append(str(s))
    if not why:
        return failure
    named = "; ".join(f"{_named([n], identities or {})}: {', '.join(w)}" for n, w in sorted(why.items()))
    return failure.model_copy(update={
        "nodes": sorted(set(failure.nodes) | set(why)),
        "message": f"{failure.message}; suspect host(s), replaced before the next attempt: {named}"})


def _slow_ranks(output_dir: Path) -> list[SlowRank]:
    """The ranks rank 0 named slow in the phase that ended on this node (none elsewhere); a file
    that does not read is reported and ignored: naming suspects is not worth failing over."""
    path = output_dir / SlowRanks.FILE
    if not path.is_file():
        return []
    try:
        return read(SlowRanks, path.read_bytes(), str(path)).slow
    except RecordError as exc:
        print(f"trnflow.backends.container: {exc}", file=sys.stderr, flush=True)
        return []


def preflight_failure(result: StageResult, identities: dict[int, NodeIdentity] | None = None,
                      per_node: int = 1, nnodes: int = 1) -> FailureReport | None:
    """Why a preflight phase's result forbids the phases after it: a core that failed its checks (its
    node is at fault), or a collective sweep with wrong results (every node is); None when every
    check passed."""
    identities = identities or {}
    every = list(range(nnodes))
    sweep = result.collectives if isinstance(result, SanityResult) else result
    if isinstance(result, SanityResult) and result.bad_cores:
        failed = [c for c in result.per_core if not c.passed]
        nodes = sorted({c.rank // per_node for c in failed if c.rank is not None}) or [0]  # else rank 0's device list
        cores = "; ".join(f"nc{c.core} of {_named([(c.rank or 0) // per_node], identities)}: "
                          f"{', '.join(c.failed)}" for c in failed) or "missing from the device list"
        return bad_host(f"NeuronCore(s) {result.bad_cores} failed known-answer tests ({cores})", nodes, identities,
                        result.bad_cores)
    if sweep is not None and getattr(sweep, "passed", True) is False:
        return bad_host(f"the collective sweep between the instances failed ({sweep.note or 'wrong results'})",
                        every, identities, sweep.bad_cores)
    return None


def next_placement(result: StageResult, placed: Placement | None, per_node: int, instance_cores: int,
                   nnodes: int) -> Placement | None:
    """Cores for every node that avoid each core the preflight found bad on it (and those excluded
    before), as the runtime places collective jobs (a contiguous range aligned to its size); None
    when a bad core cannot be placed on its node (a failed sweep, a core missing from the device
    list) or a node has too few healthy cores left."""
    if not isinstance(result, SanityResult) or not result.bad_cores:
        return None
    failed = [c for c in result.per_core if not c.passed and c.rank is not None]
    if {c.core for c in failed} != set(result.bad_cores):
        return None
    excluded = {n: set(cores) for n, cores in (placed.excluded if placed else {}).items()}
    for c in failed:
        node = excluded.setdefault(c.rank // per_node, set())
        if c.core in node:  # it failed although excluded: the node does not keep to its cores
            return None
        node.add(c.core)
    cores = {}
    for node in range(nnodes):
        try:
            fits = aligned_ranges(per_node, instance_cores, frozenset(excluded.get(node, ())))
        except FatalError:  # too few healthy cores left on it
            return None
        if not fits:
            return None
        cores[node] = visible_cores_value(fits[0])
    return Placement(round=(placed.round if placed else 0) + 1, cores=cores,
                     excluded={n: sorted(v) for n, v in sorted(excluded.items())})


def _identities(outputs: Store | None, attempt: int) -> dict[int, NodeIdentity]:
    """Each node's identity in this attempt, as its container uploaded it; {} where none can be read."""
    if outputs is None:
        return {}
    try:
        return {n.node: n for n in node_identities(outputs, attempt)}
    except Exception:  # naming the instances is a courtesy: the failure stands without it
        return {}


def _await(outputs: Store, wanted: dict[str, float], stopping: list[int], deadline: float) -> tuple[str, bytes] | None:
    """The first object of `wanted` to exist, written at its time or later (Unix seconds), and what
    it holds; None after a stop signal or past `deadline` (monotonic). A storage error is only a
    reason to look again."""
    while not stopping and time.monotonic() < deadline:
        for name, since in wanted.items():
            try:
                if any(o.name == name and o.modified >= since for o in outputs.list(name)):
                    return name, outputs.read(name)
            except Exception as exc:  # the store retried already; the deadline bounds the wait
                print(f"trnflow.backends.container: looking for {name}: {exc}", file=sys.stderr, flush=True)
        time.sleep(PROCEED_POLL_SECONDS)
    return None


MAIN_FAILED = JobOutputs.node_failure(0)
"""The main node's failure report (`_report`): the other nodes waiting between phases end on it."""
MAIN_NODE_FAILED = "the main node failed"
"""How a word that never came because the main node failed begins: that node's report is the job's."""
STORE_CLOCK_SECONDS = 1.0
"""How much earlier than the node's start an object written since may look: S3 keeps whole seconds."""
PHASE_MARGIN_SECONDS = 5.0
"""The same for the main node's phase results, with room for the clocks of the nodes to differ."""


def await_word(outputs: Store | None, phase: str, after: str, main: bool, stopping: list[int],
               timeout: float, since: float = 0.0) -> Proceed:
    """Wait for the orchestrator's word on `phase` (`proceed-<phase>.json`), a stop signal, or
    `timeout` seconds: instances nobody will use are not held until the job's own time limit. The
    other nodes also wait for the main node to have ended the phase before in this attempt
    (`phases/<after>.json` written since `since`, when this node started), so that nobody meets
    the last phase's rendezvous, which used the same port; and they end at once when the main node
    reports a failure in this attempt instead (a failed preflight: no word will come). A retry
    starts seconds after the last attempt ended at the soonest, so the last attempt's failure is
    never taken for this one's."""
    if outputs is None:  # nobody to ask: go on
        return Proceed(phase=phase, go=True)
    deadline = time.monotonic() + timeout
    word = JobOutputs.proceed(phase)
    failed = {} if main else {MAIN_FAILED: since - STORE_CLOCK_SECONDS}
    found = _await(outputs, {word: 0.0, **failed}, stopping, deadline)
    if found is not None and not main and found[0] == word:
        ended = _await(outputs, {JobOutputs.phase_result(after): since - PHASE_MARGIN_SECONDS, **failed}, stopping,
                       deadline)
        found = None if ended is None else found if ended[0] != MAIN_FAILED else ended
    if found is not None and found[0] == MAIN_FAILED:
        return Proceed(phase=phase, go=False, reason=f"{MAIN_NODE_FAILED} {after}")
    if found is not None:
        return read(Proceed, found[1], f"{outputs.url}/{word}")
    if stopping:
        return Proceed(phase=phase, go=False, reason="the container was stopped (SIGTERM) while waiting for it")
    return Proceed(phase=phase, go=False, reason=(
        f"no word from the orchestrator within {timeout / 60:g} min; the job ends rather than hold its instances"))


def _report(env: dict[str, str], service: str, r: Rendezvous, failure: FailureReport | None) -> None:
    """Leave the node's outcome where the service's caller finds it."""
    if service == "sagemaker" and failure is not None:
        path = opt_ml(env) / "output" / "failure"
        path.parent.mkdir(parents=True, exist_ok=True)
        brief = failure.model_copy(update={"message": failure.message[:FAILURE_TEXT_LIMIT // 2]})
        text = brief.model_dump_json(include={"type", "retryable", "bad_cores", "ranks", "message"})
        path.write_text(text[:FAILURE_TEXT_LIMIT])
    store = job_outputs(env, service)
    if store is None:
        return
    # Every node's failure is uploaded at once, on both services: the backend stops a job whose
    # other node failed while the main node goes on (`backends.cloud.NodeWatch`).
    if failure is not None:
        store.write(JobOutputs.node_failure(r.node_rank), failure.model_dump_json(exclude_none=True).encode())
    elif service == "batch" and r.node_rank == 0 and (r.output_dir / "result.json").is_file():
        store.write("result.json", (r.output_dir / "result.json").read_bytes())


class ForkedLauncher:
    """The launcher as a fork of this process, which runs `python -m trnflow.backends.launcher ARGS`'s
    code with `env` as its environment and this process's output: what `subprocess.Popen` of that
    command line does, without loading torch again (see `start_launcher`)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    """Held back while the child replaces this process's handlers with a new program's."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        try:
            self.pid = os.fork()
            if self.pid == 0:
                self._run(argv[3:], env)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self.SIGNALS)

    @classmethod
    def _run(cls, args: list[str], env: dict[str, str]) -> NoReturn:
        """In the forked child: the launcher to its end, then exit as `python -m` would. Never returns."""
        def body() -> None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a new program's: the launcher sets its own
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, cls.SIGNALS)  # one that came meanwhile is handled now
            os.environ.clear()
            os.environ.update(env)
            torchrun(args)

        run_as_program(body)

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self) -> int:
        """The exit code, negative for the signal that ended it, as `Popen.wait` gives it."""
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def start_launcher(argv: list[str], env: dict[str, str]) -> subprocess.Popen | ForkedLauncher:
    """The launcher of one phase: a program of its own, as the image starts it; or, where this
    process has the launcher's torch loaded already (a container forked warm from a process that
    loaded it, as the mock cloud starts them), a fork of this process, as a local job's supervisor
    starts its launcher."""
    if sys.platform.startswith("linux") and "torch.distributed.run" in sys.modules:
        return ForkedLauncher(argv, env)
    return subprocess.Popen(argv, env=env)


def run_phase(r: Rendezvous, env: dict[str, str], spec_file: Path, phase: str,
              stopping: list[int]) -> tuple[int, FailureReport | None]:
    """One phase on this node through the launcher: the launcher's exit code, and the root failure
    among this node's ranks (None when it succeeded, or no rank left a report)."""
    phase_env = {**env, JobEnv.var("phase"): phase}  # with this node's cores, once some were excluded
    (r.output_dir / SlowRanks.FILE).unlink(missing_ok=True)  # an earlier phase's or attempt's
    launcher = start_launcher(torchrun_argv(r, phase_env, spec_file), phase_env)
    # The service stops a container (a spot reclaim notice, a stopped job) with SIGTERM to its first
    # process, this one: the launcher passes it on to every rank, and training checkpoints before it ends.
    signal.signal(signal.SIGTERM, lambda signum, frame: (stopping.append(signum),
                                                         launcher.send_signal(signal.SIGTERM)))
    code = launcher.wait()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    if not code:
        return 0, None
    nproc = JobEnv.from_env(env).nproc_per_node
    exits = read_exits(rank_folder(r))
    return code, name_first_rank(root_failure(read_reports(r.output_dir), nproc, first_rank=r.node_rank * nproc,
                                              exits=exits), exits)


def _placed(env: dict[str, str], placed: Placement | None, node: int) -> dict[str, str]:
    """The phase's environment: this node's cores, once the preflight excluded some."""
    return env if placed is None else {**env, "NEURON_RT_VISIBLE_CORES": placed.cores[node]}


def _excludes(spec_file: Path, env: dict[str, str]) -> tuple[bool, int]:
    """Whether the spec excludes bad cores (`preflight.exclude_bad_cores`), and the instance's cores."""
    spec = JobSpec.model_validate_json(spec_file.read_text())  # the backend's: checked when it was submitted
    cores = env.get(INSTANCE_CORES_ENV) or instance(spec.compute.instance_type).cores
    return spec.preflight.exclude_bad_cores, int(cores)


def _verdict(r: Rendezvous, env: dict[str, str], spec_file: Path, phase: str, outputs: Store, me: NodeIdentity,
             placed: Placement | None) -> tuple[FailureReport | None, Placement | None]:
    """The main node's verdict on a preflight phase that ended: its failure (None when it passed,
    and its result is then uploaded), or the cores to check again instead, when the spec excludes
    bad cores and every node has enough healthy ones (uploaded for the other nodes)."""
    data = (r.output_dir / "result.json").read_bytes()
    try:
        result = read(RESULTS[phase], json.loads(data), f"{phase}: result.json")
    except (RecordError, ValueError) as exc:
        return FailureReport(type="FatalError", retryable=False, message=f"{phase}: {exc}"), None
    per_node = JobEnv.from_env(env).nproc_per_node
    failure = preflight_failure(result, _identities(outputs, me.attempt), per_node, r.nnodes)
    excludes, instance_cores = _excludes(spec_file, env)
    moved = next_placement(result, placed, per_node, instance_cores, r.nnodes) if failure and excludes else None
    if moved is not None:
        outputs.write(JobOutputs.placement(me.attempt, moved.round), moved.model_dump_json().encode())
        print(f"trnflow.backends.container: {phase} found bad core(s) {result.bad_cores}; checking again without them "
              f"(cores by node: {moved.cores})", file=sys.stderr, flush=True)
        return None, moved
    if failure is not None:  # the orchestrator never sees a passed preflight of these instances
        return failure, None
    if isinstance(result, SanityResult) and placed is not None:
        result.excluded_cores = sorted({c for cores in placed.excluded.values() for c in cores})
        data = result.model_dump_json().encode()
    outputs.write(JobOutputs.phase_result(phase), data)
    return None, None


def _await_placement(outputs: Store, phase: str, placed: Placement | None, stopping: list[int], timeout: float,
                     me: NodeIdentity) -> Placement | None:
    """Another node, its preflight phase done: the cores the main node chose to check again, or None
    once it decided otherwise (passed, failed) or nothing came in time."""
    wanted = JobOutputs.placement(me.attempt, (placed.round if placed else 0) + 1)
    since = me.started_at
    found = _await(outputs, {wanted: since - STORE_CLOCK_SECONDS,
                             JobOutputs.phase_result(phase): since - PHASE_MARGIN_SECONDS,
                             MAIN_FAILED: since - STORE_CLOCK_SECONDS}, stopping, time.monotonic() + timeout)
    return read(Placement, found[1], f"{outputs.url}/{wanted}") if found and found[0] == wanted else None


def _budget(env: dict[str, str], budget_usd: float) -> dict[str, str]:
    """`env` with the next phase's budget in place of the job's."""
    return {**env, JobEnv.var("budget_usd"): repr(float(budget_usd))}


def run_phases(r: Rendezvous, env: dict[str, str], service: str, spec_file: Path,
               stopping: list[int]) -> tuple[int, FailureReport | None]:
    """Every phase of TRNFLOW_PHASE in turn on this node (see the module's docstring): the exit code
    of the first that failed (or 0) and its root failure. A preflight that found bad cores, with
    `preflight.exclude_bad_cores`, runs again on other cores of the same instances, which the later
    phases then use."""
    job = JobEnv.from_env(env)
    phases = job.phase.split("+")
    outputs = job_outputs(env, service)
    me = identity(env, service, r)
    if outputs is not None:  # where the job ran (and, with EC2's launch time, how long it took to start)
        outputs.write(identity_name(me), me.model_dump_json().encode())
    wait = job.proceed_timeout_seconds
    placed: Placement | None = None
    for index, phase in enumerate(phases):
        if index:
            (r.output_dir / "result.json").unlink(missing_ok=True)  # the job's result is the last phase's
            word = await_word(outputs, phase, phases[index - 1], r.node_rank == 0, stopping, wait,
                              since=me.started_at)
            if not word.go and word.reason.startswith(MAIN_NODE_FAILED):
                return ExitCode.FAILED, None  # the main node's report says why; another would only blur it
            if not word.go and stopping and env.get(RECLAIM_NOTICE_ENV) and InstanceMetadata(env).reclaim_notice():
                return ExitCode.TRANSIENT, FailureReport(type="SpotInterruption", retryable=True, message=(
                    f"{phase} was not started: EC2 is reclaiming the spot instance"))  # stopped by it, not a person
            if not word.go:
                return ExitCode.FAILED, FailureReport(type="FatalError", retryable=False, message=(
                    f"{phase} was not started: {word.reason or 'the orchestrator said no'}"))
            if word.budget_usd is not None:  # the phase's own, reckoned when it may start
                env = _budget(env, word.budget_usd)
        while True:
            code, failure = run_phase(r, _placed(env, placed, r.node_rank), spec_file, phase, stopping)
            if code and not index and len(phases) > 1 and failure is not None and failure.retryable and not stopping:
                # a node that hung or lost its device in the preflight: which one, the peers cannot always tell
                return code, bad_host(f"{phase} failed ({failure})", list(range(r.nnodes)),
                                      _identities(outputs, me.attempt), failure.bad_cores)
            if code and failure is not None:
                return code, with_suspects(failure, _slow_ranks(r.output_dir), job.nproc_per_node,
                                           _identities(outputs, me.attempt))
            if code or index == len(phases) - 1:
                return code, failure
            if outputs is None:
                break
            if r.node_rank == 0:
                failure, moved = _verdict(r, env, spec_file, phase, outputs, me, placed)
                if failure is not None:
                    return ExitCode.FAILED, failure
            else:
                moved = _await_placement(outputs, phase, placed, stopping, wait, me)
            if moved is None:
                break
            placed = moved
    return 0, None


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    modes = {"train": "sagemaker", "sagemaker": "sagemaker", "batch": "batch"}
    if not args or args[0] not in modes:
        print("usage: python -m trnflow.backends.container train|batch  (SageMaker runs the image with `train`)",
              file=sys.stderr)
        return ExitCode.BAD_INPUT
    service = modes[args[0]]
    env = dict(os.environ)
    r = sagemaker_rendezvous(env) if service == "sagemaker" else batch_rendezvous(env)
    spec_file = _fetch_spec(env, r.output_dir.parent / "trnflow-input")
    stopping: list[int] = []
    if service == "batch" and JobEnv.one(env, "spot"):  # EC2's notice reaches only the metadata service
        env[RECLAIM_NOTICE_ENV] = "imds"
    code, failure = run_phases(r, env, service, spec_file, stopping)
    _report(env, service, r, failure)
    if failure is not None and failure.type == "BadHost":
        return ExitCode.BAD_HOST
    if failure is not None and failure.retryable:
        return ExitCode.TRANSIENT
    return code


if __name__ == "__main__":
    sys.exit(main())
