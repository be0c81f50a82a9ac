"""What SageMaker and Batch jobs share: where they run (the deployment's target), their names, and
the environment the container gets. Pure functions, but for `cloud_target`, which may read the
deployment's published settings, and `stage_spec`, which hands a spec over.
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from dataclasses import dataclass, field

from botocore.exceptions import BotoCoreError, ClientError

from trnflow import aws
from trnflow.backends.base import JobRequest, stage_result
from trnflow.backends.contract import JobEnv, JobOutputs
from trnflow.backends.failures import report_order
from trnflow.backends.run_roles import JobScope, RunRoles
from trnflow.backends.teams import declared_teams, team_of
from trnflow.device.signing import PUBLIC_KEY_ENV, SIGNING_KEY_ENV, UNSIGNED_ENV
from trnflow.errors import FatalError
from trnflow.neuron.devices import IMAGES, image_device
from trnflow.records import read
from trnflow.results import FailureReport, NodeIdentity, Proceed, StageResult
from trnflow.settings import JOB_KINDS, STAGE_KINDS, TrnflowSettings
from trnflow.specs import JobSpec, instance, is_module_reference
from trnflow.storage import Store, open_store
from trnflow.teams import TEAM_TAG, UNDECLARED, Team, Teams

log = logging.getLogger(__name__)

BASE_NAME_LENGTH = 48
"""A SageMaker job's base name: ModelTrainer appends `-<YYYYmmddHHMMSS>` and cuts the whole to 63
characters. Its log streams are `<base>-<time>/algo-<n>-<time>`, which its role's trnflow-job tag
(the base) lets it write."""
NAME_DIGEST = 16
"""Hex digits of the digest a job name cut to its limit ends in (64 bits: no other run's job name
can be made to match it)."""
SPOT_CHECKPOINT_SECONDS = 100
"""How long torchrun lets a spot job's ranks take to checkpoint after the reclaim notice (SIGTERM,
about two minutes before the instance goes) before it kills them (its default is 30 s)."""
CHECKPOINT_DIR = "/opt/ml/checkpoints"
"""Where SageMaker copies `CheckpointConfig.S3Uri` at the start of a job. trnflow writes its
checkpoints straight to that S3 folder (each object whole, the commit marker last), so a retry or
a resubmission finds every committed checkpoint even when an instance is lost mid-sync."""


@dataclass(frozen=True)
class CloudTarget:
    """The deployment a cloud job goes to: the outputs of the CloudFormation stack in `infra/`."""

    staging_url: str
    """s3:// prefix for what a job needs handed over: its spec, and SageMaker's output path."""
    image: str = ""
    """The training container for every instance family (one of `infra/docker-bake.json`'s images),
    unless `images` has one for the job's device."""
    images: dict[str, str] = field(default_factory=dict)
    """The training container by device (`neuron`, `xla`): see `image_for`."""
    job_policies: str = ""
    """The IAM path of the stack's job policies: set, every job runs as a role of its own
    (`trnflow.backends.run_roles`), and `role_arn` and `roles` are not used."""
    role_settle_seconds: float = 10.0
    """How long a job's new role is given to reach every IAM endpoint before the job is submitted
    (none in an emulated AWS, whose IAM has it everywhere at once)."""
    role_arn: str = ""
    """SageMaker execution role of every stage kind without a role in `roles`."""
    roles: dict[str, str] = field(default_factory=dict)
    """The role each stage kind's jobs run as (`STAGE_KINDS`): SageMaker's execution role, Batch's job role."""
    job_queue: str = ""
    """Batch job queue (with its fair-share scheduling policy)."""
    spot_job_queue: str = ""
    """Batch job queue of spot compute environments (single-node jobs only: see `queue_for`)."""
    recipe_modules: bool = False
    """TRNFLOW_RECIPE_MODULES where the job is submitted: the jobs may import a recipe by module too."""
    cache_public_key: str = ""
    """The key every job checks compile cache entries with (TRNFLOW_CACHE_PUBLIC_KEY), if entries are signed."""
    cache_signing_key: str = ""
    """The Secrets Manager ARN of the cache's signing key, handed to compile jobs alone (their role reads it)."""
    cache_unsigned: bool = False
    """TRNFLOW_CACHE_UNSIGNED where the job is submitted: a shared cache may be used unsigned, in the jobs too."""
    team: Team = UNDECLARED
    """The team whose run the jobs are (`trnflow.backends.teams`): its staging folder, cache keys and share."""

    def role_for(self, phase: str) -> str:
        """The fixed role a job of `phase` runs as where the deployment gives no job policies
        (SageMaker's execution role, Batch's job role): its stage kind's, else `role_arn`. A Batch job
        without a role of its own would run as its instance's role, so there is always one: FatalError
        when neither is set."""
        kind = STAGE_KINDS.get(phase, "")
        role = self.roles.get(kind, "") or self.role_arn
        if not role:
            raise FatalError(f"the {phase} phase has no role to run as: set TRNFLOW_JOB_POLICIES (the stack's "
                             f"JobPolicies output), or TRNFLOW_ROLE_{kind.upper() or 'TRAIN'} or "
                             "TRNFLOW_SAGEMAKER_ROLE_ARN; a job without a role of its own would run as its instance's")
        return role

    def queue_for(self, spec: JobSpec) -> str:
        """The Batch job queue of `spec`'s jobs: the spot queue for a spot spec (one node: Batch runs no
        multi-node job on spot), else the on-demand one."""
        return self.spot_job_queue if spec.compute.spot else self.job_queue

    def image_for(self, spec: JobSpec) -> str:
        """The image that runs `spec`: the one for its device (`neuron` on trn2 and trn3, `xla` on
        trn1, unless `compute.device` names one), else the image for every family."""
        device = image_device(spec)
        chosen = self.images.get(device) or self.image
        if not chosen:
            raise FatalError(f"compute.instance_type {spec.compute.instance_type} (compute.device "
                             f"{spec.compute.device}) runs the {device} training image, and none is set: set "
                             f"TRNFLOW_IMAGE_{device.upper()} (or TRNFLOW_IMAGE for every family) to the image built "
                             f"by `docker buildx bake -f infra/docker-bake.json {device}`")
        return chosen


SETTINGS = ("image", "image_neuron", "image_xla", "staging_url", "job_policies", "sagemaker_role_arn",
            "batch_job_queue", "batch_spot_job_queue", "cache_signing_key", "cache_public_key", "teams",
            *(f"role_{kind}" for kind in sorted(JOB_KINDS)))


def published_settings(path: str) -> dict[str, str]:
    """The settings the infra stack publishes as SSM parameters under `path` (`/trnflow/image-xla`,
    ...), by settings field; empty when none are published. They are read on every cloud run, as the
    cache's public key may be among them: FatalError when they cannot be read (no access, no
    account), since a run that went on without them could load unsigned cache entries."""
    ssm, found, token = aws.client("ssm"), [], None
    try:
        while True:  # every page: a setting left on a second page (the teams file) must never go unread
            page = aws.call(ssm.get_parameters_by_path, Path=path.rstrip("/") or "/", Recursive=False,
                            **({"NextToken": token} if token else {}))
            found += page.get("Parameters", [])
            token = page.get("NextToken")
            if not token:
                break
    except (BotoCoreError, ClientError) as exc:
        raise FatalError(f"the settings published under {path}/ in SSM cannot be read ({exc}); they may hold the "
                         "compile cache's public key, so no cloud job starts without them: give this identity "
                         f"ssm:GetParametersByPath on {path}, or set TRNFLOW_PARAMETERS_PATH to where the stack "
                         "publishes them") from None
    named = {p["Name"].rsplit("/", 1)[-1].replace("-", "_"): p["Value"] for p in found}
    return {k: v for k, v in named.items() if k in SETTINGS}


def stack_teams(settings: TrnflowSettings) -> Teams | None:
    """The stack's teams as a cloud run reads them: TRNFLOW_TEAMS, else the file the stack publishes."""
    return declared_teams(settings, settings.teams or published_settings(settings.parameters_path).get("teams"))


def cloud_target(settings: TrnflowSettings, service: str, team: Team | None = None) -> CloudTarget:
    """Where `service`'s jobs go: the images (TRNFLOW_IMAGE_NEURON, TRNFLOW_IMAGE_XLA, or
    TRNFLOW_IMAGE for both), TRNFLOW_STAGING_URL, TRNFLOW_JOB_POLICIES (or fixed roles) and, for
    Batch, TRNFLOW_BATCH_JOB_QUEUE, each taken, when unset, from the SSM parameters the infra stack
    publishes; and, for `team`'s jobs (None: the team of a run started here, `team_of`), that team's
    staging, keys and spot queue."""
    values = {name: getattr(settings, name) for name in SETTINGS}
    needed = ["staging_url", *(["batch_job_queue"] if service == "batch" else [])]
    images = ("image", *(f"image_{d}" for d in IMAGES))
    published = published_settings(settings.parameters_path)  # always: the cache's key may be there alone
    values = {name: values[name] or published.get(name) for name in SETTINGS}
    missing = [f"TRNFLOW_{name.upper()}" for name in needed if not values[name]]
    every_kind = all(values[f"role_{kind}"] for kind in JOB_KINDS)
    if not (values["job_policies"] or every_kind or values["sagemaker_role_arn"]):
        missing.append("TRNFLOW_JOB_POLICIES (or TRNFLOW_SAGEMAKER_ROLE_ARN)")
    if not any(values[name] for name in images):
        missing.append(" or ".join(f"TRNFLOW_{name.upper()}" for name in images))
    if missing:
        raise FatalError(f"compute.backend {service} needs {', '.join(missing)}; set them from the outputs of "
                         f"the CloudFormation stack in infra/ (which also publishes them under "
                         f"{settings.parameters_path}/ in SSM)")
    team = team or team_of(service, settings, values["teams"])
    if not team.unrestricted:  # a declared team's staging, cache and key are its own, never the stack's
        if not values["job_policies"]:
            raise FatalError(f"team {team.name} is declared, and its jobs would run as the deployment's fixed "
                             "roles, which no team scopes: set TRNFLOW_JOB_POLICIES (the stack's JobPolicies "
                             "output), so that each job runs as a role of its own tagged with its team")
        values |= {"staging_url": team.staging or f"{values['staging_url'].rstrip('/')}/{team.name}",
                   "cache_public_key": team.cache_public_key, "cache_signing_key": team.cache_signing_key,
                   "batch_spot_job_queue": team.batch_spot_job_queue}
    return CloudTarget(team=team, staging_url=values["staging_url"], image=values["image"] or "",
                       images={d: values[f"image_{d}"] for d in IMAGES if values[f"image_{d}"]},
                       job_policies=values["job_policies"] or "",
                       role_settle_seconds=0.0 if aws.emulated() else settings.role_settle_seconds,
                       role_arn=values["sagemaker_role_arn"] or "", job_queue=values["batch_job_queue"] or "",
                       spot_job_queue=values["batch_spot_job_queue"] or "",
                       roles={kind: values[f"role_{kind}"] for kind in JOB_KINDS
                              if values[f"role_{kind}"]},
                       recipe_modules=settings.recipe_modules, cache_public_key=values["cache_public_key"] or "",
                       cache_signing_key=values["cache_signing_key"] or "", cache_unsigned=settings.cache_unsigned)


def job_scope(request: JobRequest, target: CloudTarget) -> JobScope:
    """Where a job of `request` may write: its run's staging folder, and its stage kind's folder (the
    run's checkpoints for preflight and training, the output folder inference was given)."""
    spec = request.spec
    assert spec is not None, "cloud jobs always carry a spec"
    kind = STAGE_KINDS[request.last_phase]
    writes = {"preflight": checkpoint_s3_uri(spec, request.run_id), "train": checkpoint_s3_uri(spec, request.run_id),
              "infer": spec.inference.output_url}.get(kind)
    return JobScope(kind=kind, run_id=request.run_id, staging=f"{target.staging_url.rstrip('/')}/{request.run_id}",
                    writes=writes, team=target.team.name, job=job_name(request, target.team, BASE_NAME_LENGTH))


class JobRoles:
    """The role each job of a backend runs as: with the stack's job policies, one made for it alone
    (`trnflow.backends.run_roles`) and deleted when it ends; else its stage kind's fixed role."""

    def __init__(self, target: CloudTarget, session=None):
        self.target = target
        self._made = RunRoles(target.job_policies, session) if target.job_policies else None
        self._jobs: dict[str, str] = {}  # job -> the role made for it

    def make(self, request: JobRequest, longest: float) -> str:
        """The role for a job of `request` about to be submitted, which can exist `longest` seconds
        (every wait and attempt its service allows): until then no sweep deletes the role."""
        if self._made is None:
            return self.target.role_for(request.last_phase)
        role = self._made.make(job_scope(request, self.target), job_name(request, self.target.team), longest)
        time.sleep(self.target.role_settle_seconds)  # IAM is eventually consistent: a new role is not yet everywhere
        return role

    def submitted(self, job_id: str, role: str) -> None:
        if self._made is not None:
            self._jobs[job_id] = role

    def unused(self, role: str) -> None:
        """A made role whose job was never submitted."""
        if self._made is not None:
            self._made.delete(role)

    def ended(self, job_id: str) -> bool:
        """The job ended: the role made for it goes (once). Whether it went now. A role that could not
        be deleted is logged and tried again at the job's next look (a sweep deletes it in the end):
        the job's own end stands either way."""
        role = self._jobs.get(job_id)
        if role is None or self._made is None:
            return False
        try:
            self._made.delete(role)
        except (BotoCoreError, ClientError) as exc:
            log.warning("job %s ended, and its role %s could not be deleted (%s); trying again later", job_id,
                        role, exc)
            return False
        del self._jobs[job_id]
        return True


def job_name(request: JobRequest, team: Team, limit: int = 63) -> str:
    """`<spec name>-<phase>-<run id>` in letters, digits and dashes, at most `limit` characters (63 is
    the SageMaker limit; Batch allows 128). One that is longer, or is a declared team's, is cut to
    make room and ends in a digest of the whole and the team: two jobs never share a name (and so a
    SageMaker job's log streams, which its name scopes), even when a long model name cut their run
    ids away, or two teams use one model name and run id (each team's run ids are its own)."""
    raw = f"{request.name}-{request.phase}-{request.run_id}"
    name = re.sub(r"[^A-Za-z0-9-]", "-", raw)
    if len(name) <= limit and team.unrestricted:
        return name
    digest = hashlib.sha256(f"{team.name}/{raw}".encode()).hexdigest()[:NAME_DIGEST]
    return f"{name[:limit - NAME_DIGEST - 1].rstrip('-')}-{digest}"


def staging_prefix(target: CloudTarget, request: JobRequest) -> str:
    """Where this request's spec is handed over, and where a Batch job leaves its result."""
    return f"{target.staging_url.rstrip('/')}/{request.run_id}/{job_name(request, target.team)}"


def spec_url(target: CloudTarget, request: JobRequest) -> str:
    return f"{staging_prefix(target, request)}/input/spec.json"


def stage_spec(target: CloudTarget, request: JobRequest) -> None:
    """Hand the job's spec over in the staging bucket, where the container fetches it."""
    assert request.spec is not None, "cloud jobs always carry a spec"
    base, _, name = spec_url(target, request).rpartition("/")
    open_store(base).write(name, request.spec.model_dump_json(indent=2).encode())


STOPPED_BY_TRNFLOW = "trnflow stopped the job: "
"""How a job trnflow stopped itself (one of its nodes failed, or it waited too long for capacity) says
so in Batch's status reason."""


NODE_GRACE_SECONDS = 60.0
"""How long the main node may go on after another node failed before the job is stopped: when the
main node failed too (the other node only lost its peer), it has ended the job by then itself, and
the service's own retry rules apply to that ending."""
NODE_LOOK_SECONDS = 10.0
"""How often a running job's nodes' reports are listed (a LIST request on the staging bucket)."""


def node_reports(outputs: Store, since: float) -> list[tuple[int, FailureReport]]:
    """Every node's failure report written after `since` (seconds since the epoch), by node, each with
    `reported_at`: when it was written."""
    found = []
    for listed in outputs.list(JobOutputs.NODE_FAILURES):
        match = JobOutputs.NODE_FAILURE.fullmatch(listed.name)
        if match and listed.modified >= since:
            report = read(FailureReport, outputs.read(listed.name), f"{outputs.url}/{listed.name}")
            found.append((int(match.group(1)), report.model_copy(update={"reported_at": listed.modified})))
    return found


class NodeWatch:
    """Whether a running multi-node job should be stopped because a node other than the main one
    failed, and the failure it then ends with.

    A multi-node job ends with its main node, on both services. When another node fails, the main
    node's ranks may be stalled with nothing to end them but the attempt's timeout (a day, by
    default). So a job is stopped once another node's container has reported a failure and the main
    node has not ended within `grace` seconds. A spot reclaim is not such a failure: the service
    takes every node, and managed spot training restarts the job itself."""

    def __init__(self, grace: float = NODE_GRACE_SECONDS, every: float = NODE_LOOK_SECONDS):
        self.grace, self.every = grace, every
        self._looked: dict[str, float] = {}
        self._stopped: dict[str, tuple[Store, float]] = {}  # job -> (its nodes' reports, its attempt's start)

    def should_stop(self, job_id: str, outputs: Store, since: float) -> str | None:
        """Why to stop the running job now (`node 1 failed (CollectiveTimeout)`), once per job; else None."""
        now = time.time()
        if job_id in self._stopped or now - self._looked.get(job_id, 0.0) < self.every:
            return None
        self._looked[job_id] = now
        failed = sorted((r.reported_at or 0.0, node, r.type) for node, r in node_reports(outputs, since)
                        if node > 0 and r.type != "SpotInterruption" and (r.reported_at or 0.0) <= now - self.grace)
        if not failed:
            return None
        self._stopped[job_id] = (outputs, since)
        _, node, kind = failed[0]
        return f"node {node} failed ({kind}) and the main node went on"

    def stopped(self, job_id: str) -> bool:
        return job_id in self._stopped

    def failure(self, job_id: str, job: str) -> FailureReport:
        """The root failure among the stopped job's nodes (a node's own error before a lost peer, then
        the first written), in its words, saying that trnflow stopped `job`."""
        outputs, since = self._stopped[job_id]
        reports = node_reports(outputs, since)
        node, root = min(reports, key=lambda found: report_order(found[1]))
        return root.model_copy(update={"message": (
            f"{root.message} (node {node} of {job} failed while its main node went on; trnflow stopped the job "
            "rather than let it run to its timeout)")})


def phase_result(outputs: Store, phase: str, job_id: str) -> StageResult | None:
    """The result of a phase that ended in a job running several (`phases/<phase>.json`, uploaded by
    its main node as the phase ends), or None before then."""
    try:
        data = outputs.read(JobOutputs.phase_result(phase))
    except FileNotFoundError:
        return None
    return stage_result(job_id, data, None)


def identity_name(node: NodeIdentity) -> str:
    """Where a node's identity is uploaded, beside the job's results."""
    return JobOutputs.host(node.attempt, node.node)


def every_identity(outputs: Store) -> list[NodeIdentity]:
    """Every node of every attempt of a job, as each found itself at its start (`hosts/`), by
    attempt and node."""
    found = [read(NodeIdentity, outputs.read(o.name), f"{outputs.url}/{o.name}")
             for o in outputs.list(JobOutputs.HOSTS)]
    return sorted(found, key=lambda n: (n.attempt, n.node))


def node_identities(outputs: Store, attempt: int | None = None) -> list[NodeIdentity]:
    """The nodes of a job's attempt (the latest, unless `attempt` says), by node."""
    found = every_identity(outputs)
    attempt = attempt or max((n.attempt for n in found), default=1)
    return [n for n in found if n.attempt == attempt]


def proceed(outputs: Store, word: Proceed) -> None:
    """Tell the nodes waiting before `word.phase` to start it, or to end the job."""
    outputs.write(JobOutputs.proceed(word.phase), word.model_dump_json().encode())


MAX_RUNTIME_SECONDS = 28 * 24 * 3600
"""The longest time limit SageMaker accepts (MaxRuntimeInSeconds), and trnflow sets on either service."""


def proceed_wait_seconds(spec: JobSpec) -> int:
    """How long the nodes of a job with several phases wait between them for the orchestrator's
    word: what the stages in between may take, a compile job's wait for capacity
    (compute.max_pending_minutes) plus compute.hang_timeout_minutes."""
    return int((spec.compute.max_pending_minutes + spec.compute.hang_timeout_minutes) * 60)


def runtime_seconds(request: JobRequest) -> int:
    """The job's time limit: compute.max_runtime_hours, plus the wait between phases when it runs
    several (the preflight's own time is minutes)."""
    assert request.spec is not None, "cloud jobs always carry a spec"
    extra = proceed_wait_seconds(request.spec) if len(request.phases) > 1 else 0
    return min(MAX_RUNTIME_SECONDS, int(request.spec.compute.max_runtime_hours * 3600) + extra)


def checkpoint_s3_uri(spec: JobSpec, run_id: str) -> str:
    """The run's checkpoint folder: SageMaker syncs it to CHECKPOINT_DIR, and every retry or
    resubmission of the run sees it, which is what makes them resume."""
    return f"{spec.train.checkpoint_url.rstrip('/')}/{run_id}"


def placement(request: JobRequest) -> tuple[int, int]:
    """(nodes, processes per node) of a cloud job: the spec's, unless the request asks for fewer
    processes (the compile job runs one), which then fit on as few nodes as they can."""
    spec = request.spec
    assert spec is not None, "cloud jobs always carry a spec"
    per_node = spec.compute.cores_per_node
    if request.processes and request.processes < spec.compute.world_size:
        return -(-request.processes // per_node), min(request.processes, per_node)
    return spec.compute.nodes, per_node


def efa_environment(itype: str) -> dict[str, str]:
    """libfabric over EFA, for instance types that have it. SageMaker's torchrun driver sets these
    only for ml.trn1.32xlarge; trnflow sets them for every EFA type."""
    if not instance(itype).multi_node:
        return {}
    return {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1", "RDMAV_FORK_SAFE": "1"}


def container_environment(request: JobRequest, target: CloudTarget) -> dict[str, str]:
    """The variables every cloud job of this request gets, whatever the service."""
    spec = request.spec
    assert spec is not None, "cloud jobs always carry a spec"
    cache = spec.compile.cache_url
    job = JobEnv(
        phase=request.phase, run_id=request.run_id, spec_url=spec_url(target, request),
        nproc_per_node=placement(request)[1], checkpoint_s3_uri=checkpoint_s3_uri(spec, request.run_id),
        result_url=f"{staging_prefix(target, request)}/output", checkpoint=request.checkpoint,
        # how long its nodes wait between phases for the orchestrator's word
        proceed_timeout_seconds=proceed_wait_seconds(spec) if len(request.phases) > 1 else 1800.0,
        spot=spec.compute.spot,  # on Batch, the container watches the metadata service for the notice
        budget_usd=request.budget_usd,
        recipe_modules=target.recipe_modules and is_module_reference(spec.model.recipe))  # allowed here: there too
    env = {
        "NEURON_CC_FLAGS": f"--optlevel={spec.compile.optlevel} --cache_dir={cache}",
        "NEURON_COMPILE_CACHE_URL": cache,
        "NEURON_RT_STOCHASTIC_ROUNDING_EN": "1" if spec.compute.precision == "bf16-sr" else "0",
        **job.to_env(),
    }
    if target.cache_public_key:
        env[PUBLIC_KEY_ENV] = target.cache_public_key
    elif target.cache_unsigned:
        env[UNSIGNED_ENV] = "1"
    if request.phase == "compile" and target.cache_signing_key.startswith("arn:"):  # an ARN: never the key itself
        env[SIGNING_KEY_ENV] = target.cache_signing_key
    if spec.compute.spot:  # the reclaim notice comes two minutes ahead: torchrun's ranks get 100 s to checkpoint
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(SPOT_CHECKPOINT_SECONDS)
    return env | efa_environment(spec.compute.instance_type)


def tags(request: JobRequest, team: Team) -> dict[str, str]:
    """A job's tags: its run, and its team's (`trnflow-team`), by which a team's orchestrator may stop
    its own team's jobs alone."""
    spec = request.spec
    assert spec is not None
    return {"trnflow:job": request.name, "trnflow:phase": request.phase, "trnflow:run-id": request.run_id,
            "trnflow:spec-digest": spec.digest(), TEAM_TAG: team.name,
            **({"trnflow:spot": "true"} if spec.compute.spot else {})}
