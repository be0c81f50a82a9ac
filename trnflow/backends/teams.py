"""Which team a run belongs to: decided by who starts it, never by its spec.

- No teams declared (no `TRNFLOW_TEAMS`, and for a cloud run none published by the stack): the one
  team, `default`.
- A local run (its jobs on this machine's own cores): the teams file's `local_team`, which the
  machine's operator sets; none is refused.
- A cloud run: the IAM principal whose credentials the orchestrator holds (`sts:GetCallerIdentity`),
  by its `trnflow-team` tag. An assumed role is read by its role's tags, a user by its own. These
  tags are the operators' word: a principal that could tag itself could choose its team, and the
  stack gives none of its submitters `iam:TagRole` or `iam:TagUser` (docs/cloud.md, Teams).
A run whose team cannot be decided is refused before its first job, saying why.
"""

from __future__ import annotations

import re

from botocore.exceptions import BotoCoreError, ClientError

from trnflow import aws
from trnflow.device.signing import PUBLIC_KEY_ENV, SIGNING_KEY_ENV
from trnflow.errors import FatalError
from trnflow.records import Record
from trnflow.settings import TrnflowSettings
from trnflow.storage import open_store
from trnflow.teams import TEAM_TAG, UNDECLARED, Team, Teams, TeamUnknown, local_teams, parse_teams

PRINCIPAL = re.compile(r"arn:[\w-]+:(?:sts::\d{12}:assumed-role/(?P<role>[\w+=,.@-]+)/[\w+=,.@-]+"
                       r"|iam::\d{12}:user/(?:[\w+=,.@-]+/)*(?P<user>[\w+=,.@-]+))")
"""The principals whose tags can name a team: a role's session, or a user."""


class RunOwner(Record):
    """Whose a run id is: written once, before the run's first job, where no job writes (`claim_run`)."""

    team: str
    model: str


def declared_teams(settings: TrnflowSettings, published: str | None = None) -> Teams | None:
    """The stack's teams: the file TRNFLOW_TEAMS names (a path, or an s3:// object), else the one
    the stack publishes (`published`, its `teams` setting); None when neither names one."""
    source = settings.teams or published
    if not source:
        return None
    if not source.startswith("s3://"):
        return local_teams(source)
    folder, _, name = source.rpartition("/")
    try:
        text = open_store(folder).read(name).decode()
    except (OSError, BotoCoreError, ClientError, UnicodeDecodeError) as exc:
        raise TeamUnknown(f"teams file {source}: cannot be read ({type(exc).__name__}: {exc}); no run starts "
                         "until its team is known") from None
    return parse_teams(text, source)


def caller_team(teams: Teams) -> Team:
    """The team of the IAM principal this process acts as: FatalError naming the principal when it
    has no `trnflow-team` tag, or names a team not declared."""
    try:
        arn = aws.call(aws.client("sts").get_caller_identity)["Arn"]
    except (BotoCoreError, ClientError) as exc:
        raise TeamUnknown(f"who starts this run cannot be told (sts:GetCallerIdentity: {exc}), so neither can its "
                         "team; run with the credentials of a principal the operators tagged") from None
    found = PRINCIPAL.fullmatch(arn)
    if found is None:
        raise TeamUnknown(f"{arn} starts this run, and only an IAM role or user tagged {TEAM_TAG} may: the run's "
                         "team is its starter's tag")
    iam = aws.client("iam")
    try:
        if found["role"]:
            tags = aws.call(iam.list_role_tags, RoleName=found["role"])["Tags"]
        else:
            tags = aws.call(iam.list_user_tags, UserName=found["user"])["Tags"]
    except iam.exceptions.NoSuchEntityException:
        tags = []  # a principal IAM does not hold (an account's root, say) carries no team
    except (BotoCoreError, ClientError) as exc:
        raise TeamUnknown(f"the tags of {arn} cannot be read ({exc}), so neither can the run's team; give it "
                         "iam:ListRoleTags (or iam:ListUserTags) on itself") from None
    name = next((t["Value"] for t in tags if t["Key"] == TEAM_TAG), None)
    if name is None:
        raise TeamUnknown(f"{arn} has no {TEAM_TAG} tag: the operators tag each principal that starts runs with "
                         f"its team ({', '.join(t.name for t in teams.teams)})")
    team = teams.named(name)
    if team is None:
        raise TeamUnknown(f"{arn} is tagged {TEAM_TAG}={name}, which is not a declared team "
                         f"({', '.join(t.name for t in teams.teams)})")
    return team


def team_of(backend: str, settings: TrnflowSettings, published: str | None = None) -> Team:
    """The team of a run whose jobs go to `backend` (`published`: the stack's `teams` setting, for
    a cloud run)."""
    teams = declared_teams(settings, published if backend != "local" else None)
    if teams is None:
        return undeclared(settings)
    if backend == "local":
        if teams.local_team is None:
            raise TeamUnknown(f"the teams file {settings.teams} names no local_team: a run on this machine's "
                             "cores belongs to no team, and is refused; its operators set local_team")
        team = teams.named(teams.local_team)
        assert team is not None  # Teams checks that local_team is declared
        return team
    return caller_team(teams)


def undeclared(settings: TrnflowSettings) -> Team:
    """The one team of an install that declares none, its tracking server TRNFLOW_MLFLOW_URI."""
    return UNDECLARED.model_copy(update={"mlflow_uri": settings.mlflow_uri})


def own_team(settings: TrnflowSettings) -> Team:
    """The team of a command that acts outside a run (moving MLflow's alias, sending a kept mirror):
    the one team where none are declared; else this machine's local_team, else its principal's. A
    team that cannot be decided gives no credentials to anyone: the default team, with no server."""
    try:
        teams = declared_teams(settings)
        if teams is None:
            return undeclared(settings)
        named = teams.named(teams.local_team) if teams.local_team else None
        return named or caller_team(teams)
    except FatalError:
        return UNDECLARED


def cache_key_env(team: Team) -> dict[str, str | None]:
    """The compile cache's key variables a declared team's local jobs get in place of this machine's:
    its own public key, and its own signing key for its compile jobs (None: the variable removed, so
    a key of the machine's never signs or checks another team's cache). Nothing for the one team of
    an install that declares none: the machine's own keys stand."""
    if team.unrestricted:
        return {}
    return {PUBLIC_KEY_ENV: team.cache_public_key, SIGNING_KEY_ENV: team.cache_signing_key}
