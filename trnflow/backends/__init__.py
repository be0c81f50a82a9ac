"""The backends room: where a stage job runs. Flows and tasks see only the `Backend` protocol.

It owns the local backend (torchrun processes on this host's device), SageMaker training jobs and
AWS Batch jobs (multi-node, or single-node on spot; their requests, status and logs), the launcher program every job's
command runs (`launcher`: torchrun, each rank's log, how each rank ended), the fp32 parity
reference run (`reference`), the root-failure classification and the training container's
entrypoint (`trnflow.backends.container`). Every boto3 client comes from `trnflow.aws`. It depends on the
rooms below it only, never on the emulator or `testing`.
"""

from __future__ import annotations

import os

from trnflow.backends import machine, stack_queue
from trnflow.backends.base import Backend, JobInfo, JobRequest, JobState, run_to_end, wait
from trnflow.backends.cloud import cloud_target, job_scope, stack_teams
from trnflow.backends.runqueue import Ticket, YieldRequest, expected_wait
from trnflow.backends.teams import RunOwner, cache_key_env, declared_teams, team_of
from trnflow.device.signing import EntryKeys, keys_from, public_key, shared_cache_problem
from trnflow.errors import FatalError
from trnflow.lifecycle.locations import team_problems
from trnflow.records import read
from trnflow.settings import TrnflowSettings
from trnflow.specs import JobSpec, instance
from trnflow.storage import open_store
from trnflow.teams import Team, TeamUnknown

__all__ = ["Backend", "JobInfo", "JobRequest", "JobState", "asked_to_yield", "backend_for", "cache_keys",
           "cache_trust_problem", "claim_run", "queue_wait", "run_queue", "run_team", "run_to_end", "scope_problem",
           "team_problem", "trusted_cache_keys", "wait"]


def keeps_instance(spec: JobSpec) -> bool:
    """Whether a retry of the spec's jobs runs on the same instance, its failed cores still failed:
    on the local backend; a cloud retry gets new instances."""
    return spec.compute.backend == "local"


def backend_for(spec: JobSpec, settings: TrnflowSettings | None = None, team: Team | None = None) -> Backend:
    """The backend named by `spec.compute.backend`: the one place that chooses. Its jobs are `team`'s
    (a run's, decided once by `claim_run`); None: the team of a run started here (`team_of`)."""
    settings = settings or TrnflowSettings()
    if spec.compute.backend == "local":
        from trnflow.backends.local import LocalBackend  # loads torch (the device): only local runs need it

        return LocalBackend(settings.jobs_dir, team=team or team_of("local", settings))
    if spec.compute.backend == "sagemaker":
        from trnflow.backends.sagemaker import SageMakerBackend  # boto3 and the SDK glue: cloud runs only

        return SageMakerBackend(cloud_target(settings, "sagemaker", team))
    if spec.compute.backend == "batch":
        from trnflow.backends.batch import BatchBackend  # boto3: cloud runs only

        return BatchBackend(cloud_target(settings, "batch", team))
    raise FatalError(f"compute.backend {spec.compute.backend!r} is unknown; use local, sagemaker or batch")


def run_queue(spec: JobSpec, run_id: str, team: Team, label: str, stack: stack_queue.StackStore,
              expected_s: float | None = None, preemptible: bool = True, cost_usd: float | None = None
              ) -> Ticket | None:
    """The run's place in the queue for its capacity, entered now: this machine's cores
    (`machine`) for a local run; the stack's instances of its type (`stack_queue`) for a cloud run
    whose type the teams file limits, kept in `stack`. `Ticket.wait` admits it, and it holds its place until
    `Ticket.release`. `expected_s` and `cost_usd`: its forecast, for the expected waits of runs
    behind it and its team's daily spend;
    `preemptible`: whether it can yield at a step boundary (a run that trains). None for a cloud
    run nothing limits."""
    klass = team.priority_class(spec.compute.priority_class)
    assert klass is not None, "claim_run refuses a class the team may not use"
    if not keeps_instance(spec):
        teams = stack_teams(TrnflowSettings())
        capacity = stack_queue.limited(spec, teams)
        if capacity is None:
            return None
        entry = stack_queue.newcomer(spec, run_id, label, team, klass.name, klass.priority, capacity, expected_s,
                                     list(teams.teams), preemptible, cost_usd)
        return stack_queue.enter(entry, team, stack)
    from trnflow.device.registry import get_device  # loads torch: only a run on this machine's cores needs it

    total, device = instance(spec.compute.instance_type).cores, get_device()
    return machine.enter(run_id, label, team, klass.name, klass.priority, spec.compute.world_size, total,
                         busy=lambda cores: device.busy(cores, total) is not None, expected_s=expected_s,
                         teams=_declared(), preemptible=preemptible, cost_usd=cost_usd)


def _declared() -> list[Team]:
    """Every team this machine's teams file declares (none without one)."""
    declared = declared_teams(TrnflowSettings())
    return list(declared.teams) if declared else []


def queue_wait(spec: JobSpec, team: Team, expected_s: float | None, stack: stack_queue.StackStore | None = None
               ) -> tuple[float | None, str, int]:
    """For a run of `spec` starting now: how long it would wait in its queue (None, with the reason,
    when that cannot be told), and how many runs hold or wait there: this machine's for a local run;
    for a cloud run of a type the teams file limits, the stack's in `stack`. (None, "", 0) when it
    would not queue."""
    klass = team.priority_class(spec.compute.priority_class)
    if klass is None:
        return None, f"team {team.name} may not run {spec.compute.priority_class} runs", 0
    if keeps_instance(spec):
        found = machine.entries()
        newcomer = machine.newcomer("(this run)", "this run", team, klass.name, klass.priority,
                                    spec.compute.world_size, instance(spec.compute.instance_type).cores, expected_s,
                                    _declared())
    else:
        teams = stack_teams(TrnflowSettings()) if stack is not None else None
        capacity = stack_queue.limited(spec, teams)
        if capacity is None:
            return None, "", 0
        with stack.deciding():
            found = [e for e in stack.entries() if e.pool == spec.compute.instance_type]
        newcomer = stack_queue.newcomer(spec, "(this run)", "this run", team, klass.name, klass.priority, capacity,
                                        expected_s, list(teams.teams))
    wait, why = expected_wait(newcomer, found)
    return wait, why, len(found)


def asked_to_yield(run_id: str) -> YieldRequest | None:
    """Whether the run has been asked to yield its capacity (and to whom): its training stops at its
    next step boundary, and the run queues again."""
    held = machine.ticket(run_id) or stack_queue.ticket(run_id)
    return held.asked_to_yield() if held is not None else None


def cache_keys(spec: JobSpec, settings: TrnflowSettings | None = None, team: Team | None = None) -> EntryKeys:
    """The keys `spec`'s jobs check compile cache entries with, as their backend gives them: this
    process's (TRNFLOW_CACHE_PUBLIC_KEY, TRNFLOW_CACHE_UNSIGNED) for local jobs; for cloud jobs, the
    deployment's (`cloud_target`: the environment, then the stack's SSM parameters). No signing key:
    the orchestrator predicts and records hits, it never writes an entry. `team`: the run's (None:
    decided here)."""
    settings = settings or TrnflowSettings()
    if spec.compute.backend == "local":
        overlay = cache_key_env(team or team_of("local", settings))
        own = keys_from({k: v for k, v in {**os.environ, **overlay}.items() if v is not None})
        return EntryKeys(trusted=own.trusted, unsigned_ok=own.unsigned_ok)
    target = cloud_target(settings, spec.compute.backend, team)
    trusted = public_key(target.cache_public_key) if target.cache_public_key else None
    return EntryKeys(trusted=trusted, unsigned_ok=target.cache_unsigned)


def trusted_cache_keys(spec: JobSpec, settings: TrnflowSettings | None = None, team: Team | None = None
                       ) -> EntryKeys:
    """`cache_keys`, once they let `spec`'s jobs use its compile cache: FatalError when it is a
    shared one nothing checks, or the deployment cannot be read at all."""
    keys = cache_keys(spec, settings, team)
    if problem := shared_cache_problem(spec.compile.cache_url, keys.checks, keys.unsigned_ok):
        raise FatalError(problem)
    return keys


def cache_trust_problem(spec: JobSpec, settings: TrnflowSettings | None = None) -> str | None:
    """Why `trusted_cache_keys` refuses `spec`, or None."""
    try:
        trusted_cache_keys(spec, settings)
    except FatalError as exc:
        return str(exc)
    return None


def scope_problem(spec: JobSpec, settings: TrnflowSettings | None = None) -> str | None:
    """Why `spec`'s cloud jobs could not be given roles of their own (a folder IAM cannot name in a
    role's tags), or None; None too where the deployment cannot be read (`cache_trust_problem` says
    so) or gives fixed roles."""
    if spec.compute.backend == "local":
        return None
    try:
        target = cloud_target(settings or TrnflowSettings(), spec.compute.backend)
    except FatalError:
        return None
    if not target.job_policies:
        return None
    for phase in ("train", "infer"):
        try:
            job_scope(JobRequest(spec, phase, "20261202T000000-0123abcd"), target).tags(0)
        except FatalError as exc:
            return str(exc)
    return None


def _team_and_owners(spec: JobSpec, settings: TrnflowSettings) -> tuple[Team, str]:
    """The team of a run of `spec` started here, and where its run ids' owner records are kept: the
    team's staging folder for a cloud run (beside its runs' folders, where no job writes), this
    machine's TRNFLOW_HOME for a local one."""
    if spec.compute.backend == "local":
        return team_of("local", settings), str(settings.home.expanduser().resolve() / "owners")
    target = cloud_target(settings, spec.compute.backend)
    return target.team, target.staging_url


def run_team(spec: JobSpec, settings: TrnflowSettings | None = None) -> Team:
    """The team a run of `spec` started here belongs to (`trnflow.backends.teams`): FatalError when
    it cannot be decided."""
    return _team_and_owners(spec, settings or TrnflowSettings())[0]


def team_problem(spec: JobSpec, settings: TrnflowSettings | None = None, writes_reference: bool = False) -> str | None:
    """Why a run of `spec` started here would be refused for its team: the team cannot be decided, or
    the spec reaches outside it (`team_problems`; `writes_reference`: this run writes gate.reference);
    None when neither."""
    try:
        team = run_team(spec, settings)
    except TeamUnknown as exc:
        return f"team: {exc}"
    except FatalError:  # the deployment's settings cannot be read: `cache_trust_problem` says so
        return None
    return "; ".join(team_problems(spec, team, writes_reference)) or None


def claim_run(spec: JobSpec, run_id: str, settings: TrnflowSettings | None = None) -> Team:
    """Admit run `run_id` of `spec` for its team, before its first job: FatalError when the team
    cannot be decided, the spec reaches outside it, or the run id is another team's or model's. The
    first use of a run id binds it to its team and model (a create-only owner record); a rerun of
    the same run (to resume it) finds its own record. The run's team."""
    settings = settings or TrnflowSettings()
    team, owners = _team_and_owners(spec, settings)
    if problems := team_problems(spec, team):
        raise FatalError("refused for its team: " + "; ".join(problems))
    owner = RunOwner(team=team.name, model=spec.name)
    store, name = open_store(owners), f"{run_id}.owner.json"
    if not store.create(name, owner.model_dump_json().encode()):
        found = read(RunOwner, store.read(name), f"{store.url}/{name}")
        if (found.team, found.model) != (owner.team, owner.model):
            raise FatalError(f"run id {run_id} is run {found.model} of team {found.team}'s; a run id names one run "
                             f"of one model, for good: leave --run-id out for a new one")
    return team
