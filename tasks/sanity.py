"""Stage 1: hardware sanity checks on every NeuronCore the job will use."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from trnflow.backends import keeps_instance
from trnflow.errors import FatalError, TrnflowError
from trnflow.measures import CoreChecks
from trnflow.reporting.report import sanity_markdown
from trnflow.results import SanityResult
from trnflow.specs import JobSpec
from trnflow.tasks import _artifacts
from trnflow.tasks._jobs import run_job
from trnflow.teams import Team
from trnflow.workload.memory import estimate


def _failures(result: SanityResult, per_node: int) -> str:
    """Each failed core and its checks; on a cloud job, also the node and the instance it is on."""
    return "; ".join(f"nc{c.core}{_where(result, c, per_node)}: {', '.join(c.failed)}"
                     for c in result.per_core if not c.passed)


def _where(result: SanityResult, core: CoreChecks, per_node: int) -> str:
    """' of node 1 (i-0abc...)' for a core of a cloud job whose instances are known, else ''."""
    hosts = result.ran_on.hosts if result.ran_on and result.ran_on.backend != "local" else []
    if not hosts or core.rank is None:
        return ""
    node = core.rank // per_node
    return f" of node {node} ({hosts[node]})" if node < len(hosts) else f" of node {node}"


@task(name="sanity", cache_policy=NO_CACHE)
def sanity_check(spec: JobSpec, run_id: str, then_train: bool = False, *, team: Team | None = None) -> SanityResult:
    """Known-answer tests of every engine of each core the job is placed on.

    With `preflight.exclude_bad_cores`, cores that fail are excluded and another placement is
    checked, until a healthy set is found or too few cores remain. The job that finds every core
    healthy also sweeps the collectives between them, for the collectives stage. With `then_train`,
    on a backend that allocates instances per job (SageMaker, Batch), the job keeps its instances
    for the run's training, which then runs on the very instances checked here. Its jobs are
    `team`'s (`StageRunner.team`; None: decided here).

    Returns:
        The per-core results; `cores` lists the verified cores the later stages run on, and
        `collectives` the sweep between them.

    Raises:
        FatalError: naming each bad core and the tests it failed.
    """
    logger = get_run_logger()
    excluded: set[int] = set()
    checked: list[CoreChecks] = []  # the cores that failed, then every core of the attempt that decided
    try:
        result = _check(spec, run_id, excluded, checked, logger, ("train",) if then_train else (), team)
    finally:
        if checked:
            everything = sorted(checked, key=lambda c: c.core)
            _artifacts.markdown(spec, "sanity", sanity_markdown(
                everything, sorted(excluded), sorted({c.core for c in checked} - excluded)),
                "known-answer tests per NeuronCore and engine")
    result.excluded_cores = sorted(excluded | set(result.excluded_cores))  # a cloud job excludes in its allocation
    if result.collectives is not None:  # the links between these cores, swept by the same job
        result.collectives = result.collectives.model_copy(
            update={"phase": "sanity", "device": result.device, "cores": result.cores, "ran_on": result.ran_on})
    result.memory = estimate(spec)  # what each core must hold to train this spec
    note = f"; excluded bad core(s) {result.excluded_cores}" if result.excluded_cores else ""
    cores = result.cores
    if cores is None:  # a cloud job: its instances were checked, each on its own cores
        result.cores = sorted({c.core for c in result.per_core})
        result.summary = f"all {len(result.per_core)} cores passed on every instance{note}"
    else:
        result.summary = f"all {len(cores)} cores passed (nc{cores[0]}-nc{cores[-1]}){note}"
    if result.device is not None:
        result.summary += f" on the {result.device.name}" + (" device" if result.device.name != "emulator" else "")
    if result.checkpoint:  # where the run's checkpoints go took one and gave it back
        trip = result.checkpoint
        shards = f" in {trip.ranks} shards" if trip.layout == "sharded" else ""
        result.summary += (f"; checkpoint round trip ok ({trip.bytes / 2**20:.1f} MiB{shards}, "
                           f"{trip.write_seconds + trip.read_seconds:.1f}s)")
    listed = result.inventory
    if listed and listed.source != "emulator":
        result.summary += f"; {listed.source} lists {listed.devices} devices, {listed.cores} cores"
    if listed and listed.held:
        result.summary += "; held by other processes: " + ", ".join(
            f"nc{core} (pid {h.pid} {h.command})" for core, h in listed.held.items())
    return result


def _check(spec: JobSpec, run_id: str, excluded: set[int], checked: list[dict], logger,
           keep_for: tuple[str, ...], team: Team | None) -> SanityResult:
    """Check placements until one is healthy; `excluded` and `checked` grow as it goes. On a cloud
    backend the job's own nodes do this inside their allocation (`trnflow.backends.container`), and an
    instance they cannot place healthy cores on is replaced (`BadHost`)."""
    local = keeps_instance(spec)  # this machine places the cores (no backend built: that reads the deployment)
    excludes = spec.preflight.exclude_bad_cores and local
    while True:
        try:
            result = run_job(spec, "sanity", run_id, exclude_cores=excluded, keep_for=keep_for, team=team)
            assert isinstance(result, SanityResult)
        except TrnflowError as exc:  # a core that hangs is named by its peers
            if not (exc.bad_cores and excludes) or set(exc.bad_cores) <= excluded:
                raise
            excluded |= set(exc.bad_cores)
            logger.warning("excluding NeuronCore(s) %s (%s) and checking other cores", exc.bad_cores, exc)
            continue
        bad = result.bad_cores
        final = not bad or not excludes or set(bad) <= excluded
        checked.extend(c for c in result.per_core if final or not c.passed)
        if not bad:
            return result
        if set(bad) <= excluded:
            raise FatalError(f"NeuronCore(s) {bad} failed again although excluded: the job is pinned to them "
                             "(NEURON_RT_VISIBLE_CORES); unpin it or pin healthy cores", bad_cores=bad)
        failures = _failures(result, spec.compute.cores_per_node)
        if not excludes:
            also = ", or set preflight.exclude_bad_cores: true to go on without them" if local else ""
            raise FatalError(f"NeuronCore(s) {bad} failed known-answer tests ({failures}); replace the instance{also}",
                             bad_cores=bad)
        excluded |= set(bad)
        logger.warning("excluding NeuronCore(s) %s (%s) and checking other cores", bad, failures)
