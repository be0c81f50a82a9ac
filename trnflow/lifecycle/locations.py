"""Before a run trains: every location it will write is writable, the registry it will judge and
register in can be read whole, and the reference it will be judged against is there. A run that
would fail on these after hours of training fails in seconds instead, naming the location and what
is wrong."""

from __future__ import annotations

import uuid

from trnflow.errors import DataError, FatalError
from trnflow.lifecycle.gate import parse_metrics
from trnflow.lifecycle.registry import Registry, RegistryCorrupt
from trnflow.redact import without_credentials
from trnflow.specs import JobSpec
from trnflow.storage import open_store
from trnflow.teams import LOCAL_QUOTA, Team, inside, is_loopback
from trnflow.urls import normalise_url


def _probe(url: str) -> str | None:
    """Write, read back and delete a small object at `url`: None when all three work, else why not."""
    name = f".trnflow-probe-{uuid.uuid4().hex[:12]}"
    try:
        store = open_store(url)
        store.write(name, b"probe")
        if store.read(name) != b"probe":
            return "an object written there reads back different"
        store.delete(name)
    except Exception as exc:  # any failure here is the answer: permissions, a missing bucket, a full disk
        return f"{type(exc).__name__}: {exc}"
    return None


def locations(spec: JobSpec) -> dict[str, str]:
    """The spec fields naming a location the run writes, and their URLs."""
    found = {"train.checkpoint_url": spec.train.checkpoint_url, "compile.cache_url": spec.compile.cache_url,
             "inference.output_url": spec.inference.output_url}
    if spec.registry_url:
        found["registry_url"] = spec.registry_url
    return found


def team_problems(spec: JobSpec, team: Team, writes_reference: bool = False) -> list[str]:
    """Where `spec` reaches outside what `team` may: each location it writes outside the team's
    prefix for it, each it reads outside the team's prefixes, a tracking server other than the
    team's (one on loopback is allowed for a run on this machine's cores), a Batch share or priority
    other than the team's; a line each, naming the field, the location and the team's prefix. With
    `writes_reference` (`trnflow reference`, which writes gate.reference), that file must lie where
    the team's runs write their own files: its checkpoints or outputs prefix, never a folder it may
    only read. A priority class the team may not use is refused for every team; nothing else for the
    one team of an install that declares none."""
    problems = []
    wanted = spec.compute.priority_class
    if team.priority_class(wanted) is None:
        problems.append(f"compute.priority_class: team {team.name} may not run {wanted} runs (its classes: "
                        f"{', '.join(c.name for c in team.classes)}); name one of those, or ask the operators")
    problems += quota_problems(spec, team)
    if team.unrestricted:
        return problems
    fields = locations(spec)
    reference = spec.gate.reference if spec.gate.reference != "auto" else None  # auto: under the checkpoints
    own = [p for p in (team.checkpoints, team.outputs) if p is not None]
    if writes_reference and reference and not any(inside(reference, p) for p in own):
        problems.append(f"gate.reference: {without_credentials(reference)} is outside what team {team.name} may "
                        f"write ({', '.join(own)}); `trnflow reference` writes it, so put it under one of those")
    for field, prefix in team.writes().items():
        url = fields.get(field)
        if url is not None and prefix is not None and not inside(url, prefix):
            problems.append(f"{field}: {without_credentials(url)} is outside team {team.name}'s prefix {prefix}; "
                            "write under it (the operators decide each team's prefixes, a spec cannot)")
    readable = [p for p in (*team.writes().values(), *team.read) if p is not None]
    reads = {f"data.{name}": getattr(spec.data, name) for name in ("train", "holdout", "inference")}
    for field, value in (("train.init_from", spec.train.init_from), ("gate.reference", spec.gate.reference)):
        if value and value not in ("champion", "auto"):
            reads[field] = value
    for key, value in spec.model.params.items():  # a recipe's inputs: pretrained weights, a tokenizer
        if isinstance(value, str) and (value.startswith(("s3://", "file://")) or key == "pretrained"):
            reads[f"model.params.{key}"] = value if "://" in value else normalise_url(value)
    for field, url in reads.items():
        if url and not any(inside(url, prefix) for prefix in readable):
            problems.append(f"{field}: {without_credentials(url)} is outside what team {team.name} may read "
                            f"({', '.join(readable)}); read from there, or ask the operators to add it to the "
                            "team's `read`")
    uri = spec.tracking.mlflow_uri
    if uri and not (team.serves(uri) or (spec.compute.backend == "local" and is_loopback(uri))):
        where = f"its own, {team.mlflow_uri}" if team.mlflow_uri else "none declared"
        problems.append(f"tracking.mlflow_uri: {uri} is not team {team.name}'s tracking server ({where}); a run "
                        "mirrors only to its team's server, which alone gets the team's credentials")
    if spec.compute.backend == "batch" and spec.compute.spot and not team.batch_spot_job_queue:
        problems.append(f"compute.spot: team {team.name} has no Batch spot queue of its own (its "
                        "batch_spot_job_queue in the teams file), and the stack's is no team's; run on demand, or "
                        "ask the operators for the team's spot capacity (infra/cloudformation/team.yaml)")
    if spec.compute.scheduling_priority and spec.compute.backend == "batch":
        problems.append(f"compute.scheduling_priority: team {team.name}'s runs are ordered by their priority class "
                        "(compute.priority_class), never by a spec's number; remove it")
    share = spec.compute.share_identifier
    if share and team.share_identifier and share != team.share_identifier:
        problems.append(f"compute.share_identifier: {share} is not team {team.name}'s share "
                        f"({team.share_identifier}); remove it, the team's is used")
    return problems


def quota_problems(spec: JobSpec, team: Team) -> list[str]:
    """A run its team's quotas could never admit, on any of its instance types: each type it has no
    quota for, or less than the run needs, where the team may not borrow."""
    compute = spec.compute
    if compute.backend == "local":
        wants = {LOCAL_QUOTA: (compute.world_size, "NeuronCores of this machine")}
    else:
        wants = {t: (compute.nodes, f"{t} instances") for t in compute.instance_choices}
    problems = []
    for key, (units, what) in wants.items():
        quota = team.quota(key)
        if quota is not None and units > quota and not team.borrow:
            have = f"a quota of {quota}" if quota else "no quota"
            problems.append(f"compute: the run needs {units} {what} and team {team.name} has {have} there and may "
                            "not borrow; ask for fewer, or ask the operators for a quota (the teams file's quotas)")
    return problems if len(problems) == len(wants) else []


def check_locations(spec: JobSpec, retraining: bool = False) -> None:
    """FatalError naming each location that cannot be written, a registry file that cannot be read,
    and a gate reference file that is missing, malformed or (unless `retraining`) evaluated at none
    of the steps this run evaluates at."""
    problems = [f"{field} {without_credentials(url)}: cannot be written ({why}); make it writable for "
                "this run, or point the field elsewhere"
                for field, url in locations(spec).items() if (why := _probe(url)) is not None]
    reference = reference_problem(spec, retraining=retraining)
    if reference:
        problems.append(reference)
    if spec.registry_url:
        try:
            Registry(spec.registry_url).check(spec.name)
        except RegistryCorrupt as exc:
            problems.append(f"registry_url: {exc}")
    if problems:
        raise FatalError("before training: " + "; ".join(problems))


def reference_problem(spec: JobSpec, remote: bool = True, retraining: bool = False) -> str | None:
    """What is wrong with `gate.reference` when it names a metrics file: missing, unreadable, not a
    metrics file with `gate.metric` at every point, or, for a run judged step by step (not
    `retraining`, which is judged on its final point), sharing no evaluation step with the spec, so
    the gate could compare nothing. None when it is fine, or is `champion`, `auto` (the run trains
    it when it is not on record) or unset; an s3:// one is read only when `remote`."""
    reference = spec.gate.reference
    if reference in (None, "champion", "auto") or (reference.startswith("s3://") and not remote):
        return None
    base, _, name = reference.rpartition("/")
    try:
        text = open_store(base).read(name).decode()
    except FileNotFoundError:
        return (f"gate.reference: {reference} does not exist; create it with `trnflow reference SPEC`, or point "
                "gate.reference at an existing metrics file")
    except Exception as exc:  # permissions, a missing bucket, bytes that are not text
        return f"gate.reference: {reference} cannot be read ({type(exc).__name__}: {exc})"
    try:
        document = parse_metrics(text, reference, spec.gate.metric)
    except DataError as exc:
        return f"gate.reference: {exc}"
    steps = sorted(set(document.steps()))
    if not retraining and not any(spec.evaluates_at(step) for step in steps):
        return (f"gate.reference: {reference} was evaluated at steps {steps}, and this spec evaluates at steps "
                f"{spec.evaluation_steps_text()} (train.steps {spec.train.steps}, gate.eval_every "
                f"{spec.gate.eval_every}): none in common, so the gate would judge nothing. Write a reference "
                "for this spec with `trnflow reference SPEC` (with the same --set options), or evaluate at the "
                "reference's steps")
    return None
