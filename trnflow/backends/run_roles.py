"""Each cloud job's own IAM role: the write scope of one run, which the job cannot widen.

The infra stack keeps one managed policy per stage kind under its IAM path (`job-base`, which every
job has, and `job-preflight`, `job-compile`, `job-train`, `job-infer`). Their write statements name
no run: their resources end in the role's own tags, `${aws:PrincipalTag/trnflow-staging}` (the run's
staging folder) and `${aws:PrincipalTag/trnflow-writes}` (the folder the kind writes: the run's
checkpoints, or the inference output of the version it embeds). As a job is submitted the orchestrator
makes a role for it alone under that path, tags it with those two folders, and attaches the base
policy and its kind's; the job's containers can change neither (no job policy grants any IAM action),
so a job of run A can write under run A's folders and nowhere else, and a role without the tags
grants no write at all (IAM matches no resource whose policy variable is missing). The role is
deleted when its job ends; roles a stopped orchestrator left behind are deleted by the next one once
their `trnflow-expires` tag has passed. docs/cloud.md says why this way and not another.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_chain, wait_fixed

from trnflow import aws
from trnflow.errors import FatalError
from trnflow.storage.s3 import split_s3_url
from trnflow.teams import DEFAULT_TEAM, TEAM_TAG

log = logging.getLogger(__name__)

RUN_TAG, STAGING_TAG, WRITES_TAG, EXPIRES_TAG = "trnflow-run", "trnflow-staging", "trnflow-writes", "trnflow-expires"
JOB_TAG = "trnflow-job"
"""The tags of a job's role: its run, and the folders its policies let it write (keys in the stack's
buckets, no bucket), when it may be deleted even if no orchestrator saw its job end, its job's name
(the log streams it may write: `<job name>/...`) and its team (`trnflow.teams.TEAM_TAG`)."""
BASE_POLICY = "job-base"
"""The policy every job's role has: read the inputs, hand back in its run's staging folder, logs."""
TAG_VALUE = re.compile(r"[\w.:/=+\-@ ]{1,256}")
"""What IAM takes as a tag value (letters, digits, spaces and `_.:/=+-@`, at most 256)."""
TRUST = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Principal": {"Service": ["sagemaker.amazonaws.com", "ecs-tasks.amazonaws.com"]},
    "Action": "sts:AssumeRole"}]}
"""Who may take a job's role: SageMaker (its execution role) and ECS (a Batch container's job role)."""
SLACK_SECONDS = 24 * 3600
"""How long after its job's longest life a role a stopped orchestrator left behind is kept."""
SWEEP_SECONDS = 3600.0
"""How often a process looks for job roles left behind."""
NEW_ROLE_WAITS = (1.0, 2.0, 4.0, 8.0)
"""How long to wait before each new try to give a role made a moment ago its policies, when IAM
answers AccessDenied: the stack lets an orchestrator attach them to its own team's roles alone,
judged by the role's tags, which IAM may not yet see everywhere (it is eventually consistent)."""
_SWEPT: dict[tuple[str, str], float] = {}  # (the stack's policy path, a team) -> when this process last swept it


def _access_denied(exc: BaseException) -> bool:
    return isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "AccessDenied"


@dataclass(frozen=True)
class JobScope:
    """Where one job may write: what its role's tags say."""

    kind: str
    """The stage kind (`preflight`, `compile`, `train`, `infer`): which policy the role gets."""
    run_id: str
    staging: str
    """s3:// URL of the run's staging folder (its spec, results, failure reports, the orchestrator's word)."""
    writes: str | None
    """s3:// URL of the folder the kind writes: the run's checkpoint folder (preflight, train), the
    inference output's folder (infer); None for compile, whose writes are the shared, signed cache."""
    team: str = DEFAULT_TEAM
    """The run's team (`trnflow.backends.teams`): the job policies scope every resource by it too."""
    job: str = ""
    """The job's name: a SageMaker job writes only its own log streams, `<job name>/...`."""

    def tags(self, expires: float) -> dict[str, str]:
        """The role's tags, each checked as IAM takes them: FatalError naming the folder otherwise."""
        found = {RUN_TAG: self.run_id, TEAM_TAG: self.team, STAGING_TAG: _key(self.staging, "TRNFLOW_STAGING_URL"),
                 EXPIRES_TAG: str(int(expires))}
        if self.writes is not None:
            setting = "inference.output_url" if self.kind == "infer" else "train.checkpoint_url"
            found[WRITES_TAG] = _key(self.writes, setting)
        if self.job:
            found[JOB_TAG] = self.job
        for key, value in found.items():
            if not TAG_VALUE.fullmatch(value):
                raise FatalError(f"{value!r} cannot be a job role's {key} tag (IAM takes letters, digits, spaces "
                                 "and _.:/=+-@, at most 256 of them): rename the run or folder to those")
        return found


def _key(url: str, setting: str) -> str:
    """The folder's key in its bucket, without slashes at its ends."""
    if not url.startswith("s3://"):
        raise FatalError(f"{setting} is {url!r}: a cloud job writes only to s3:// folders")
    _, key = split_s3_url(url)
    key = key.strip("/")
    if not key:
        raise FatalError(f"{setting} is {url!r}: a job writes a folder of a bucket, never a whole bucket; add one")
    return key


@dataclass(frozen=True)
class PolicyPath:
    """Where the stack keeps the jobs' policies (its `job-policies` setting:
    `arn:aws:iam::<account>:policy/<prefix>/`), and so where the jobs' roles go."""

    arn: str

    def __post_init__(self):
        if not re.fullmatch(r"arn:[\w-]+:iam::\d{12}:policy/[\w+=,.@-]+/", self.arn):
            raise FatalError(f"TRNFLOW_JOB_POLICIES is {self.arn!r}, not the IAM path of the stack's job policies "
                             "(arn:aws:iam::<account>:policy/<prefix>/, the stack's JobPolicies output)")

    @property
    def path(self) -> str:
        return "/" + self.arn.split(":policy/", 1)[1]

    @property
    def prefix(self) -> str:
        return self.path.strip("/")

    def policy(self, name: str) -> str:
        return f"{self.arn}{name}"

    def role_name(self, scope: JobScope, job: str) -> str:
        """`<prefix>-run-<kind>-<16 hex>`: one per job submission (a hash of its scope, its name and the
        time), so that no job's end deletes a role another job still runs as."""
        digest = hashlib.sha256(f"{scope}|{job}|{time.time_ns()}".encode()).hexdigest()[:16]
        return f"{self.prefix}-run-{scope.kind}-{digest}"

    def owns(self, role_arn: str) -> bool:
        """Whether `role_arn` is a job role this path's orchestrators make (and so may delete)."""
        account = self.arn.split(":")[4]
        return re.fullmatch(rf"arn:[\w-]+:iam::{account}:role{re.escape(self.path)}"
                            rf"{re.escape(self.prefix)}-run-[a-z]+-[0-9a-f]{{16}}", role_arn) is not None


class RunRoles:
    """Makes and deletes the jobs' roles (IAM, through `trnflow.aws`)."""

    def __init__(self, policies: str, session=None):
        self.where = PolicyPath(policies)
        self._iam = aws.client("iam", boto_session=session)

    def make(self, scope: JobScope, job: str, seconds: float) -> str:
        """A new role for one job of `scope` that runs at most `seconds`: its ARN."""
        self.sweep(scope.team)
        name = self.where.role_name(scope, job)
        tags = scope.tags(time.time() + seconds + SLACK_SECONDS)
        role = aws.call(self._iam.create_role, Path=self.where.path, RoleName=name,
                        AssumeRolePolicyDocument=json.dumps(TRUST), MaxSessionDuration=12 * 3600,
                        Description=f"trnflow {scope.kind} job {job} of run {scope.run_id}"[:1000],
                        Tags=[{"Key": k, "Value": v} for k, v in tags.items()])["Role"]
        try:
            for policy in (BASE_POLICY, f"job-{scope.kind}"):
                self._attach(name, self.where.policy(policy))
        except ClientError as exc:
            self.delete(role["Arn"])
            raise FatalError(f"the {scope.kind} job's role cannot be given the stack's policy ({exc}); check "
                             f"TRNFLOW_JOB_POLICIES ({self.where.arn}) against the stack's JobPolicies output"
                             ) from None
        log.info("job %s runs as %s, writing %s", job, name, ", ".join(
            f"{k}={v}" for k, v in tags.items() if k in (STAGING_TAG, WRITES_TAG)))
        return role["Arn"]

    def _attach(self, name: str, policy: str) -> None:
        """Attach `policy` to the new role `name`, waiting out IAM's spread of its tags (NEW_ROLE_WAITS)."""
        retrying = Retrying(
            retry=retry_if_exception(_access_denied), stop=stop_after_attempt(len(NEW_ROLE_WAITS) + 1),
            wait=wait_chain(*(wait_fixed(w) for w in NEW_ROLE_WAITS)), sleep=lambda s: time.sleep(s), reraise=True,
            before_sleep=lambda state: log.info("IAM does not yet let %s be given %s (a new role's tags spread "
                                                "within seconds); trying again", name, policy))
        retrying(aws.call, self._iam.attach_role_policy, RoleName=name, PolicyArn=policy)

    def delete(self, role_arn: str) -> None:
        """Delete a job role this path's orchestrators made (its policies first); any other is left alone."""
        if not self.where.owns(role_arn):
            log.warning("not deleting %s: not a job role under %s", role_arn, self.where.path)
            return
        name = role_arn.rsplit("/", 1)[1]
        try:
            attached = aws.call(self._iam.list_attached_role_policies, RoleName=name)["AttachedPolicies"]
            for policy in attached:
                aws.call(self._iam.detach_role_policy, RoleName=name, PolicyArn=policy["PolicyArn"])
            aws.call(self._iam.delete_role, RoleName=name)
        except self._iam.exceptions.NoSuchEntityException:
            pass  # deleted already (by another orchestrator's sweep)

    def sweep(self, team: str) -> list[str]:
        """Delete `team`'s job roles whose time is over (their job's longest life and a day): those a
        stopped orchestrator never saw end. Another team's are its own orchestrators' to delete (the
        stack lets an orchestrator delete its own team's job roles alone). At most once every
        SWEEP_SECONDS in a process, and best effort: a role that cannot be read or deleted now (another
        orchestrator's sweep may have taken it) is left for the next. The ARNs deleted."""
        now = time.time()
        if now - _SWEPT.get((self.where.arn, team), 0.0) < SWEEP_SECONDS:
            return []
        _SWEPT[(self.where.arn, team)] = now
        deleted = []
        try:
            roles, marker = [], None
            while True:
                more = {"Marker": marker} if marker else {}
                page = aws.call(self._iam.list_roles, PathPrefix=self.where.path, **more)
                roles += page["Roles"]
                if not page.get("IsTruncated"):
                    break
                marker = page["Marker"]
        except (BotoCoreError, ClientError) as exc:
            log.warning("could not list the job roles under %s to delete those left behind (%s)", self.where.path, exc)
            return []
        for role in (r for r in roles if self.where.owns(r["Arn"])):
            try:
                tags = {t["Key"]: t["Value"] for t in aws.call(self._iam.list_role_tags,
                                                                 RoleName=role["RoleName"])["Tags"]}
                expires = tags.get(EXPIRES_TAG, "")
                if tags.get(TEAM_TAG) == team and expires.isdigit() and int(expires) < now:
                    self.delete(role["Arn"])
                    deleted.append(role["Arn"])
            except (BotoCoreError, ClientError) as exc:
                log.info("left job role %s for a later sweep (%s)", role["RoleName"], exc)
        if deleted:
            log.info("deleted %d job role(s) whose jobs' time was over", len(deleted))
        return deleted
