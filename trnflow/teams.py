"""Teams: who a run belongs to, and so what it may reach.

A team is declared by the stack's operators, never by a spec: its name, the prefixes its runs may
read and write, its compile cache and signing key, its tracking server and its Batch share. The
declarations are one file (`TRNFLOW_TEAMS`, or the stack's published `teams` setting), read here.
Which team a run belongs to is decided by who starts it (`trnflow.backends.teams`); what the spec
says must then lie inside that team's prefixes (`trnflow.lifecycle.locations.team_problems`).

Where no file is declared (a laptop, a stack for one team) there is one team, `default`, which may
reach every location its user can: there is nobody else's to protect.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trnflow.errors import FatalError
from trnflow.records import problems

TEAM_TAG = "trnflow-team"
"""The tag of an IAM principal (role or user) that names the team whose runs it starts, and of
every job role, whose policies scope each resource by it."""
DEFAULT_TEAM = "default"
"""The team of an install that declares none."""
NAME = r"^[a-z0-9][a-z0-9-]{0,39}$"
CREDENTIALS_ENV = re.compile(r"[A-Z][A-Z0-9_]{0,63}")
QUOTA_KEY = re.compile(r"local|[a-z][a-z0-9-]*\.[a-z0-9-]+")
LOCAL_QUOTA = "local"
"""A team's quota key for one machine's NeuronCores (the local backend)."""


class TeamUnknown(FatalError):
    """A run's team cannot be decided: the teams file cannot be read or is not one, or its starter
    names no declared team."""


def _prefix(value: str) -> str:
    """A location prefix as the checks compare it: `s3://bucket/key` or `file:///abs`, no trailing
    slash, no `.` or `..` segments (which would let a location climb out of it)."""
    scheme, sep, rest = value.partition("://")
    if not sep and value.startswith("/"):
        scheme, sep, rest = "file", "://", value
    if scheme not in ("s3", "file") or not sep or not rest.strip("/"):
        raise ValueError(f"{value!r} is not an s3://bucket/prefix or an absolute path")
    if scheme == "file":  # a file URL's %-escapes are its path's characters
        rest = unquote(rest)
    segments = rest.split("/")
    if any(s in (".", "..") for s in segments) or "//" in rest.strip("/"):
        raise ValueError(f"{value!r} has an empty, `.` or `..` segment")
    return f"{scheme}://{rest.rstrip('/')}"


def inside(url: str, prefix: str) -> bool:
    """Whether `url` is `prefix` or lies under it, segment by segment (`s3://b/team-ab` is not
    inside `s3://b/team-a`); a URL with a `.` or `..` segment lies inside nothing."""
    try:
        found, within = _prefix(url), _prefix(prefix)
    except ValueError:
        return False
    return found == within or found.startswith(within + "/")


def is_loopback(url: str) -> bool:
    """Whether an http(s) URL names this machine (`localhost`, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin(url: str) -> str:
    """An http(s) URL's scheme, host and port (`https://mlflow.example:443`), which credentials are
    bound to; an ARN is its own origin."""
    if url.startswith("arn:"):
        return url
    parts = urlsplit(url)
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme, 0)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


class PriorityClass(BaseModel):
    """A class of runs and its place in the stack's order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME, description="The class's name, as a spec's compute.priority_class names it.")
    priority: int = Field(ge=0, le=9999, description="Its place in the order (higher first): its Batch jobs' "
                          "scheduling priority, which orders them within their share of the fair-share queue.")


DEFAULT_CLASSES = (PriorityClass(name="production", priority=100), PriorityClass(name="experiment", priority=10))
"""The classes of a teams file that declares none, and of an install that declares no teams."""


class Team(BaseModel):
    """One team as the operators declare it. A run of the team writes only under its prefixes,
    reads its data only from them and `read`, uses its cache and key, and sends tracking
    credentials only to its server."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME, description="The team's name (lowercase letters, digits and `-`): the "
                      "`trnflow-team` tag of its submitters' IAM principals and of its jobs' roles.")
    checkpoints: str | None = Field(description="The prefix its runs' train.checkpoint_url lies in (checkpoints "
                                    "and TensorBoard files). None only for the default team: anywhere.")
    registry: str | None = Field(description="The prefix its registry_url lies in (each model's versions, "
                                 "champion and history).")
    outputs: str | None = Field(description="The prefix its inference.output_url lies in.")
    cache: str | None = Field(description="The prefix its compile.cache_url lies in: its own compile cache, which "
                              "only its compile jobs write. Several teams name one only where the operators chose "
                              "to share a cache (docs/cloud.md says what that means).")
    read: list[str] = Field(default_factory=list, description="Further prefixes its runs may read (data, "
                            "pretrained weights, gate references), besides the prefixes above.")
    staging: str | None = Field(None, description="Cloud runs: the prefix of its runs' staging folders (specs, "
                                "results, owner records). None: the stack's staging_url, then `<team>/`.")
    cache_signing_key: str | None = Field(None, description="Its compile cache's signing key: the ARN of a Secrets "
                                          "Manager secret only its compile jobs' roles read (or, on one machine, "
                                          "a PEM file). None: the stack's.")
    cache_public_key: str | None = Field(None, description="The key its jobs check cache entries with "
                                         "(`ed25519:<base64>`). None: the stack's.")
    mlflow_uri: str | None = Field(None, description="Its MLflow tracking server: the only one its runs may "
                                   "mirror to (besides one on loopback, on one machine), and the only host that "
                                   "gets its credentials.")
    mlflow_credentials: str = Field("MLFLOW_TRACKING", description="The start of the orchestrator's environment "
                                    "variables holding its tracking credentials: `<it>_TOKEN`, or `<it>_USERNAME` "
                                    "and `<it>_PASSWORD`.")
    share_identifier: str | None = Field(None, pattern=r"^[A-Za-z0-9_]{1,255}$", description="Its Batch fair-share "
                                         "identifier: its jobs' share of the queue, whatever a spec says.")
    classes: tuple[PriorityClass, ...] = Field(DEFAULT_CLASSES, min_length=1, description="The priority classes its "
                                               "runs may use. In the teams file: their names, of the file's "
                                               "`classes`; unset, every one of them.")
    quotas: dict[str, int] = Field(default_factory=dict, description="What its runs may hold at once, per "
                                   "instance type: instances (`trn1.32xlarge: 4`), or `local`: NeuronCores of one "
                                   "machine. A type it has no quota for is refused before launch; none declared: "
                                   "no quota anywhere (only the capacity itself).")
    weight: float = Field(1.0, gt=0, le=1000, description="Its fair share against other teams' weights: the order "
                          "of waiting runs of one class, and its Batch share's weight.")
    borrow: bool = Field(False, description="Whether its runs may hold more than its quota, from what lending "
                         "teams leave idle (taken back by preemption at a checkpoint when they need it).")
    lend: bool = Field(True, description="Whether what it leaves idle of its quota may be lent to teams that "
                       "borrow: its own runs take it back, the borrower's yielding at a checkpoint.")
    daily_spend_usd: float | None = Field(None, gt=0, description="US dollars its runs may spend in a day (UTC): "
                                          "a run whose forecast would take its team past it waits in the queue "
                                          "until the next day; None: no limit.")
    batch_spot_job_queue: str | None = Field(None, pattern=r"^[A-Za-z0-9_:/.-]{1,255}$", description="Its own "
                                             "Batch spot job queue (the team stack's BatchSpotJobQueue output), "
                                             "whose instances' role reaches its own spot cluster alone. None: its "
                                             "runs get no Batch spot capacity (the stack's spot queue is the "
                                             "default team's, and a spot job can read its instance's role).")

    @field_validator("checkpoints", "registry", "outputs", "cache", "staging")
    @classmethod
    def _one_prefix(cls, value: str | None) -> str | None:
        return None if value is None else _prefix(value)

    @field_validator("read")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        return [_prefix(v) for v in value]

    @field_validator("quotas")
    @classmethod
    def _quota_keys(cls, value: dict[str, int]) -> dict[str, int]:
        for key, quota in value.items():
            if not QUOTA_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is neither an instance type (trn1.32xlarge) nor `local` (this machine)")
            if quota < 0:
                raise ValueError(f"{key}: {quota} is below zero; a team with no share of a type has quota 0")
        return value

    @field_validator("mlflow_credentials")
    @classmethod
    def _credentials_env(cls, value: str) -> str:
        if not CREDENTIALS_ENV.fullmatch(value):
            raise ValueError(f"{value!r} is not the start of an environment variable's name (A-Z, 0-9, _)")
        return value

    def serves(self, uri: str) -> bool:
        """Whether `uri` is the team's tracking server (same scheme, host and port): the one server a
        run may mirror to, and the only one that gets the team's credentials."""
        return self.mlflow_uri is not None and origin(uri) == origin(self.mlflow_uri)

    @property
    def unrestricted(self) -> bool:
        """The default team of an install that declares none: it may reach anywhere its user can."""
        return self.name == DEFAULT_TEAM and self.checkpoints is None

    def priority_class(self, name: str | None) -> PriorityClass | None:
        """The class `name` (a spec's compute.priority_class) is for this team's runs: None when the team
        may not use it; the lowest class it may use when `name` is None."""
        if name is None:
            return min(self.classes, key=lambda c: c.priority)
        return next((c for c in self.classes if c.name == name), None)

    def quota(self, key: str) -> int | None:
        """Its quota of `key` (an instance type, or `local`): None when it declares none at all; 0 for a
        type it declares none of when it declares others."""
        return self.quotas.get(key, 0) if self.quotas else None

    def writes(self) -> dict[str, str | None]:
        """The team's write prefixes, by the spec field that must lie in each."""
        return {"train.checkpoint_url": self.checkpoints, "registry_url": self.registry,
                "inference.output_url": self.outputs, "compile.cache_url": self.cache}


UNDECLARED = Team(name=DEFAULT_TEAM, checkpoints=None, registry=None, outputs=None, cache=None)
"""The one team of an install that declares none."""


class Teams(BaseModel):
    """The teams file: every team of the stack, and the team of runs started on this machine's own
    cores (the local backend)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: tuple[PriorityClass, ...] = Field(DEFAULT_CLASSES, min_length=1, description="The stack's priority "
                                               "classes, each with its place in the order (production and "
                                               "experiment unless declared).")
    teams: list[Team] = Field(min_length=1, description="Every team of the stack.")
    capacity: dict[str, int] = Field(default_factory=dict, description="Instances of each type the stack's "
                                     "cloud runs may hold at once (its compute environments' size, its SageMaker "
                                     "account quota). A type not listed: the sum of its teams' quotas, when every "
                                     "team has one; otherwise nothing limits it and its runs never queue.")
    local_team: str | None = Field(None, description="The team of runs started with compute.backend local "
                                   "where this file is read. None: such runs are refused (a shared machine's "
                                   "runs belong to someone).")

    @model_validator(mode="before")
    @classmethod
    def _classes_named(cls, data: object) -> object:
        """A team's `classes` in the file are names of the file's classes: each becomes that class (a
        class written out whole is left to be checked against them, after validation)."""
        if not isinstance(data, dict) or not isinstance(data.get("teams"), list):
            return data
        declared = data.get("classes", [c.model_dump() for c in DEFAULT_CLASSES])
        if not isinstance(declared, list) or not all(isinstance(c, dict) for c in declared):
            return data  # the file's classes are not a list of classes: validation says so
        known = {c.get("name"): c for c in declared}
        teams = []
        for n, team in enumerate(data["teams"]):
            if isinstance(team, dict) and isinstance(team.get("classes"), list):
                unknown = [c for c in team["classes"] if not isinstance(c, dict) and c not in known]
                if unknown:
                    raise ValueError(f"teams.{n}.classes (team {team.get('name')}): {unknown} are not among the "
                                     f"file's classes ({', '.join(map(str, known))})")
                team = {**team, "classes": [c if isinstance(c, dict) else known[c] for c in team["classes"]]}
            teams.append(team)
        return {**data, "teams": teams}

    @field_validator("capacity")
    @classmethod
    def _capacity_keys(cls, value: dict[str, int]) -> dict[str, int]:
        for key, count in value.items():
            if key == "local" or not QUOTA_KEY.fullmatch(key):
                raise ValueError(f"{key!r} is not an instance type (trn1.32xlarge); this machine's capacity is its "
                                 "cores")
            if count < 0:
                raise ValueError(f"{key}: {count} is below zero")
        return value

    @model_validator(mode="after")
    def _complete(self) -> Teams:
        for field in ("name", "priority"):
            values = [getattr(c, field) for c in self.classes]
            if len(set(values)) != len(values):
                raise ValueError(f"classes: two classes have one {field}; each has its own place in the order")
        for n, team in enumerate(self.teams):
            if "classes" not in team.model_fields_set:  # unset: every class of the file's
                self.teams[n] = team = team.model_copy(update={"classes": self.classes})
            foreign = [c.name for c in team.classes if c not in self.classes]
            if foreign:
                raise ValueError(f"team {team.name}: classes {foreign} are not the file's classes "
                                 f"({', '.join(c.name for c in self.classes)})")
        names = [t.name for t in self.teams]
        if len(set(names)) != len(names):
            raise ValueError(f"a team is declared twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        if DEFAULT_TEAM in names:
            raise ValueError(f"{DEFAULT_TEAM!r} is the one team of a stack that declares none, which the stack's "
                             "policies do not scope: name the team otherwise")
        for team in self.teams:
            missing = [f for f, v in team.writes().items() if v is None]
            if missing:
                raise ValueError(f"team {team.name}: no prefix for {', '.join(missing)}; a declared team "
                                 "writes only where it is given a place")
            places = [(f, v) for f, v in team.writes().items() if v is not None]
            for n, (field, prefix) in enumerate(places):  # a job that writes one must never write another
                for other, within in places[n + 1:]:
                    if inside(prefix, within) or inside(within, prefix):
                        raise ValueError(f"team {team.name}: its {field} prefix {prefix} and its {other} prefix "
                                         f"{within} overlap; a job that may write one would write the other: "
                                         "give each a folder of its own")
        if self.local_team is not None and self.local_team not in names:
            raise ValueError(f"local_team {self.local_team!r} is not a declared team ({', '.join(names)})")
        return self

    def named(self, name: str) -> Team | None:
        return next((t for t in self.teams if t.name == name), None)


def parse_teams(text: str, origin_: str) -> Teams:
    """The teams file's text: FatalError naming the file and the field when it is not one."""
    try:
        return Teams.model_validate(yaml.safe_load(text))
    except yaml.YAMLError as exc:
        raise TeamUnknown(f"teams file {origin_}: not YAML ({exc})") from None
    except ValidationError as exc:
        raise TeamUnknown(f"teams file {origin_}: {problems(exc)}; the stack's operators declare the teams "
                         "(docs/cloud.md, Teams)") from None


def local_teams(path: str) -> Teams:
    """A teams file on this machine."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as exc:
        raise TeamUnknown(f"teams file {path}: cannot be read ({exc.strerror or exc}); set TRNFLOW_TEAMS to the "
                         "operators' teams file") from None
    return parse_teams(text, path)
