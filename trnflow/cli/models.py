"""`trnflow models`: the model registry (list, show, promote, roll back, export)."""
from __future__ import annotations

import contextlib
import datetime as dt
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from trnflow.backends.teams import own_team
from trnflow.cli.console import RED, cli_console, shown
from trnflow.errors import DataError, ExitCode, FatalError, TrnflowError
from trnflow.lifecycle.cards import CardGate
from trnflow.lifecycle.digests import check_version
from trnflow.lifecycle.exports import copy_export
from trnflow.lifecycle.registry import ChampionChange, PromotionConflict, Registry, RegistryCorrupt, RegistryEntry
from trnflow.records import ADAPTER_FOLDER
from trnflow.redact import without_credentials
from trnflow.reporting.tracking import point_champion
from trnflow.settings import TrnflowSettings
from trnflow.urls import normalise_url
from trnflow.workload.embeddings import latest_folder, point_current, version_url

models_app = typer.Typer(help="Look at and change the model registry (registry_url).", no_args_is_help=True)
console = cli_console()
err = cli_console(stderr=True)
RegistryOpt = Annotated[str, typer.Option("--registry", "-r", help="The registry: a directory or s3:// URL "
                                          "(the spec's registry_url).", envvar="TRNFLOW_REGISTRY_URL")]
ModelArg = Annotated[str, typer.Argument(help="The model: the job spec's name.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@contextlib.contextmanager
def _registry(url: str) -> Iterator:

    try:
        yield Registry(normalise_url(url))
    except ValueError as exc:
        err.print(f"--registry {without_credentials(url)}: {exc}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except PromotionConflict as exc:
        err.print(f"{exc}", **RED)
        raise typer.Exit(ExitCode.CONFLICT) from None
    except FatalError as exc:
        err.print(f"{exc}", **RED)
        raise typer.Exit(ExitCode.FAILED) from None


def _when(ts: float | None) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M") if ts else ""


@models_app.command("ls")
def ls(model: Annotated[str | None, typer.Argument(help="One model's versions; all models when left out.")] = None,
       registry: RegistryOpt = ..., as_json: JsonOpt = False):
    """Every version with its gate metric's final value, watermark and gate outcome; the champion
    is starred (`--json` adds each version's checkpoint)."""
    with _registry(registry) as reg:
        names = [model] if model else reg.models()
        rows, unreadable = [], []
        for name in names:
            try:
                champion = reg.champion(name)
            except RegistryCorrupt as exc:
                champion = None
                unreadable.append(str(exc))
            versions, corrupt = reg.readable(name)
            unreadable += [str(c) for c in corrupt]
            for v in versions:
                starred = bool(champion and champion.version == v.version)
                rows.append({"model": name, "version": v.version, "champion": starred,
                             **v.entry.model_dump(include={"status", "watermark", "global_step", "checkpoint",
                                                           "registered_at"}),
                             **_gate_metric(v.entry)})
    for problem in unreadable:
        err.print(problem, **RED)
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        _versions_table(rows, registry)
    if unreadable:
        raise typer.Exit(ExitCode.FAILED)


def _gate_metric(entry: RegistryEntry) -> dict:
    """The metric the version was gated on (accuracy for one registered without a verdict) and its
    final value."""
    metric = (entry.verdict.metric if entry.verdict else None) or "accuracy"
    value = entry.metrics.get(metric)
    return {"metric": metric, "value": value if isinstance(value, int | float) else None}


def _versions_table(rows: list[dict], registry: str) -> None:
    table = Table("model", "version", "", "status", "gate metric", "watermark", "global step", "registered",
                  caption="`trnflow models show MODEL VERSION` for a version's checkpoint, metrics and verdict")
    for r in rows:
        value = f"{r['metric']} {r['value']:.4f}" if r["value"] is not None else ""
        table.add_row(shown(r["model"]), f"v{r['version']}", "[green]★ champion[/green]" if r["champion"] else "",
                      shown(r["status"] or ""), value, shown(r["watermark"] or ""), str(r["global_step"] or ""),
                      _when(r["registered_at"]))
    console.print(table if rows else f"no models in {shown(registry)}")


@models_app.command("show")
def show(model: ModelArg, version: Annotated[int | None, typer.Argument(help="Default: the champion.")] = None,
         registry: RegistryOpt = ..., as_json: JsonOpt = False):
    """One version's whole entry (the champion's by default), and the history of champions."""
    with _registry(registry) as reg:
        entry = reg.version(model, version) if version is not None else reg.champion(model)
        if entry is None:
            err.print(f"{model} has no champion in {registry}; name a version (`trnflow models ls`)", **RED)
            raise typer.Exit(ExitCode.FAILED)
        history = reg.history(model)
    if as_json:
        print(json.dumps({"entry": entry.entry.model_dump(mode="json"),
                          "history": [h.model_dump(mode="json") for h in history]}, indent=2))
        return
    console.print_json(entry.entry.model_dump_json())
    for record in history:
        console.print(f"generation {record.generation}: {record.action} v{record.version} "
                      f"(was {'v' + str(record.previous) if record.previous else 'none'}) {_when(record.at)} "
                      f"{shown(record.reason)}", highlight=False)


def _outputs(reg: Registry, model: str, version: int) -> str | None:
    """The output location of `version`, checked to hold its complete outputs (None: none recorded,
    as for a version registered before outputs were versioned)."""
    out = reg.version(model, version).entry.output_url
    if out and latest_folder(out, version) is None:
        raise FatalError(f"{model} v{version} has no complete outputs at {version_url(out, version)}, so it cannot "
                         f"be published with the change of champion; write them with `trnflow infer SPEC --model "
                         f"{version}`, then try again")
    return out


def _change_champion(reg: Registry, model: str, version: int, action: str,
                     reason: str) -> tuple[ChampionChange, str]:
    """Make `version` the champion (`action` promote or rollback) and point `current` at its
    outputs; if the pointer cannot be moved, the change is undone by its inverse, so the history
    stays a stack. Returns the record and what was published."""
    check_version(reg.version(model, version))  # its files are still the ones registered
    out = _outputs(reg, model, version)
    before = reg.champion(model)
    generation = reg.generation(model)
    if action == "rollback":
        record = reg.rollback(model, reason=reason, expected_generation=generation)
    else:
        record = reg.promote(model, version, reason=reason, expected_generation=generation)
    if out is None:
        return record, "no outputs recorded for it, so `current` was not moved"
    try:
        pointer = point_current(out, model, version)
    except Exception as exc:
        why = f"publishing v{version}'s outputs failed: {exc}"
        if action == "rollback":
            assert before is not None  # a rollback needs a champion to roll back from
            reg.promote(model, before.version, reason=why, expected_generation=record.generation)
        elif before is not None:
            reg.rollback(model, reason=why, expected_generation=record.generation)
        raise FatalError(f"could not publish v{version}'s outputs at {out} ({exc}); the champion is "
                         f"v{before.version if before else version} and `current` is unchanged") from None
    return record, f"{pointer['rows']} rows published as current under {without_credentials(out)}"


def _move_alias(reg: Registry, model: str, record: ChampionChange) -> list[str]:
    """After a change of champion: MLflow's `champion` alias follows it on the servers the new and
    the previous champion's runs were mirrored to (it never decides anything). A line for each."""
    servers = {reg.version(model, record.version).entry.tracking}
    if record.previous:
        with contextlib.suppress(TrnflowError):  # the change stands even if the old champion's entry is unreadable
            servers.add(reg.version(model, record.previous).entry.tracking)
    team = own_team(TrnflowSettings())  # the servers' credentials go to its own server alone
    return [point_champion(uri, model, record.version, team) for uri in sorted(s for s in servers if s)]


@models_app.command("promote")
def promote(model: ModelArg, version: Annotated[int, typer.Argument(help="The version to make champion.")],
            registry: RegistryOpt = ..., reason: Annotated[str, typer.Option(help="Why, for the history.")] = "manual",
            as_json: JsonOpt = False):
    """Make a version the champion and publish its outputs (exit 4 if another promotion wins the race)."""
    with _registry(registry) as reg:
        _crowned(reg, model, version, "promote", reason, as_json,
                 lambda r: f"v{version} is the champion[/green] (generation {r.generation})")


@models_app.command("rollback")
def rollback(model: ModelArg, registry: RegistryOpt = ...,
             reason: Annotated[str, typer.Option(help="Why, for the history.")] = "manual rollback",
             as_json: JsonOpt = False):
    """Make the previous champion the champion again, and publish its outputs again."""
    with _registry(registry) as reg:
        _crowned(reg, model, reg.rollback_target(model), "rollback", reason, as_json,
                 lambda r: f"v{r.version} is the champion again[/green] (rolled back from v{r.previous})")


def _crowned(reg: Registry, model: str, version: int, action: str, reason: str, as_json: bool,
             said: Callable[[ChampionChange], str]) -> None:
    """Make `version` the champion (`action`: promote or rollback), move the tracking server's alias,
    and say so: `said(record)`, the line's words after the model's name, or the record as JSON."""
    record, published = _change_champion(reg, model, version, action, reason)
    tracking = _move_alias(reg, model, record)
    if as_json:
        print(json.dumps({**record.model_dump(mode="json"), "published": published, "tracking": tracking}))
        return
    console.print(f"[green]{shown(model)} {said(record)}; {shown(published)}")
    for line in tracking:
        console.print(shown(line), highlight=False)


@models_app.command("export")
def export(model: ModelArg, out: Annotated[Path, typer.Argument(help="A new or empty local folder.")],
           version: Annotated[int | None, typer.Option(help="Default: the champion.")] = None,
           adapter: Annotated[bool, typer.Option(
               "--adapter", help="A LoRA run's adapter alone, in PEFT's format (PeftModel.from_pretrained loads it "
               "onto its base), instead of the merged model.")] = False,
           registry: RegistryOpt = ..., as_json: JsonOpt = False):
    """Copy a version's export (the champion's by default) to a local folder, every file checked
    against its checksum: the model in its own library's format (for hf-encoder and hf-causal-lm,
    what `from_pretrained` loads; for a LoRA run, the model merged with its adapter), for use
    outside trnflow or as another spec's `model.params.pretrained`. Its card (README.md) is written
    again with the gate's verdict on the version."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        err.print(f"OUT {out}: is not an empty folder; give a new or empty one", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT)
    with _registry(registry) as reg:
        if version is not None and version not in [v.version for v in reg.readable(model)[0]]:
            err.print(f"--version {version}: {shown(model)} has no such version in {shown(registry)} "
                      "(`trnflow models ls` lists them)", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        entry = reg.version(model, version) if version is not None else reg.champion(model)
        if entry is None:
            err.print(f"{shown(model)} has no champion in {shown(registry)}; name a version with --version "
                      "(`trnflow models ls`)", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        if entry.entry.export is None:
            err.print(f"{shown(model)} v{entry.version} has no export: its recipe "
                      f"({shown(entry.entry.recipe.recipe if entry.entry.recipe else None)}) writes none", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT)
        digests = entry.entry.digests
        if digests is None or digests.export is None:
            err.print(f"{shown(model)} v{entry.version}: registered without a digest of its export, so nothing shows "
                      "it is the one that was registered; register the model again from a run", **RED)
            raise typer.Exit(ExitCode.FAILED)
        try:
            verdict = entry.entry.verdict
            gate = CardGate(version=entry.version, status=entry.entry.status, metrics=entry.entry.metrics,
                            reason=verdict.reason if verdict else None)
            marker = copy_export(entry.entry.export, out, digests.export, part=ADAPTER_FOLDER if adapter else None,
                                 gate=gate)
        except DataError as exc:
            err.print(shown(exc), **RED)
            raise typer.Exit(ExitCode.FAILED) from None
    if as_json:
        print(json.dumps({"model": model, "version": entry.version, "export": entry.entry.export, "out": str(out),
                          "files": sorted(marker.files), "base": entry.entry.base}))
    else:
        console.print(f"[green]{shown(model)} v{entry.version}[/green]: {len(marker.files)} files to {shown(str(out))}")
        if adapter:
            folder = entry.entry.recipe.params.get("pretrained") if entry.entry.recipe else None
            console.print(f"the adapter's base: {shown(str(folder))} (digest {entry.entry.base})")
