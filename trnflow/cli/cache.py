"""`trnflow cache`: look after a persistent compile cache (list, stats, verify, prune)."""
from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from trnflow.cli.console import RED, cli_console, plain, shown
from trnflow.device.cache import COMPILER_VERSION, CORRUPT, NEURONXCC, CompileCache
from trnflow.device.signing import PUBLIC_KEY_ENV, SIGNING_KEY_ENV, generate, keys_from
from trnflow.errors import ExitCode, TrnflowError
from trnflow.redact import without_credentials
from trnflow.urls import normalise_url

cache_app = typer.Typer(help="Inspect and clean a persistent compile cache.", no_args_is_help=True)
console = cli_console()
err = cli_console(stderr=True)
UrlArg = Annotated[str, typer.Argument(help="The cache: a directory, file:// or s3:// URL (compile.cache_url).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON.")]


@contextlib.contextmanager
def _cache(url: str) -> Iterator:
    """The cache at `url`; a bad URL, missing credentials or a missing bucket, a folder that is not a
    cache root or a garbled record end the command with what went wrong (exit 2)."""

    try:
        yield CompileCache(normalise_url(url), keys=keys_from())
    except TrnflowError as exc:  # says where and what to do
        err.print(str(exc), **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except ValueError as exc:
        err.print(f"{without_credentials(url)}: {exc}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except Exception as exc:
        if type(exc).__module__.startswith("botocore"):
            err.print(f"{without_credentials(url)}: {exc}. Check the bucket name and your AWS "
                                       "credentials (AWS_PROFILE, AWS_ENDPOINT_URL for a moto server)", **RED)
            raise typer.Exit(ExitCode.BAD_INPUT) from None
        raise


def _entries(url: str) -> list:
    with _cache(url) as cache:
        return cache.entries()


def _age(ts: float | None) -> str:
    if ts is None:
        return "never"
    hours = (time.time() - ts) / 3600
    return f"{hours:.1f} h ago" if hours < 48 else f"{hours / 24:.0f} d ago"


LS_COLUMNS = ("compiler", "key", "state", "size", "hits", "last used", "written by")
RIGHT_ALIGNED = frozenset({"size", "hits"})


def _columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """The rows as aligned text columns under their header. A cache can hold thousands of entries, which
    Rich would take seconds to lay out as a table."""
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(header)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.rjust(w) if h in RIGHT_ALIGNED else c.ljust(w)
                         for h, c, w in zip(header, cells, widths, strict=True)).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


@cache_app.command("ls")
def ls(url: UrlArg, as_json: JsonOpt = False):
    """Every entry with its state, size, hit count and last use, and who wrote it: trnflow, or the
    Neuron compiler (in a cache the `xla` device shares with it). It reads the cache's listing and
    index, never an artifact."""
    found = _entries(url)
    if as_json:  # one entry a line: thousands of them dump far faster unindented
        print("[" + ",\n ".join(json.dumps(e.as_dict()) for e in found) + "]")
        return
    print(_columns(LS_COLUMNS, [(plain(e.compiler), plain(e.key), e.state, f"{e.bytes / 1024:,.0f} KiB", str(e.hits),
                                 _age(e.last_used), e.origin) for e in found]))


@cache_app.command()
def stats(url: UrlArg, as_json: JsonOpt = False):
    """Totals per compiler version and state."""
    found = _entries(url)
    totals: dict[str, dict] = {}
    for e in found:
        t = totals.setdefault(e.compiler, {"entries": 0, "bytes": 0, "hits": 0, "by_state": {}})
        t["entries"] += 1
        t["bytes"] += e.bytes
        t["hits"] += e.hits
        t["by_state"][e.state] = t["by_state"].get(e.state, 0) + 1
    if as_json:
        print(json.dumps(totals, indent=2))
        return
    for version, t in totals.items():
        states = ", ".join(f"{n} {s}" for s, n in sorted(t["by_state"].items()))
        console.print(f"{version}: {t['entries']} entries ({states}), {t['bytes'] / 1024**2:.1f} MiB, "
                      f"{t['hits']} hits")
    if not totals:
        console.print("empty cache")


@cache_app.command()
def verify(url: UrlArg, as_json: JsonOpt = False):
    """Check every done entry's artifact against its checksum; exit 1 if any is corrupt. The Neuron
    compiler's entries have no checksums of trnflow's: they are counted, not checked."""

    with _cache(url) as cache:
        found = cache.entries(deep=True)
        corrupt = {f"{e.compiler}/{e.key}": e for e in found if e.state == CORRUPT}
        problems = {entry: cache.problem(entry) for entry in corrupt}
    if as_json:
        print(json.dumps({"checked": len(found), "corrupt": [e.key for e in corrupt.values()]}, indent=2))
    else:
        for entry, problem in problems.items():
            console.print(f"[red]corrupt[/red] {shown(problem or entry)}; the next compile rebuilds it "
                          "(or prune it with --failed)", highlight=False)
        unchecked = sum(e.origin == NEURONXCC for e in found)
        note = f" ({unchecked} written by neuronx-cc, which records no checksums)" if unchecked else ""
        console.print(f"{len(found)} entries checked, {len(corrupt)} corrupt{note}")
    raise typer.Exit(ExitCode.FAILED if corrupt else ExitCode.OK)


@cache_app.command()
def keygen(
    path: Annotated[Path, typer.Argument(help="Where to write the private key (PEM); it must not exist yet.")],
    as_json: JsonOpt = False,
):
    """Make the key pair that signs a shared cache's entries. The private key (written to PATH, readable
    by you alone) belongs to the compile stage only; every job checks entries with the public key printed."""

    try:
        public = generate(path)
    except FileExistsError:
        err.print(f"{path} exists already; keygen never overwrites a key (remove it, or pick another path)", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    except OSError as exc:
        err.print(f"{path}: {exc.strerror}", **RED)
        raise typer.Exit(ExitCode.BAD_INPUT) from None
    if as_json:
        print(json.dumps({"private_key": str(path), "public_key": public}, indent=2))
        return
    console.print(f"private key: {path} (for the compile stage alone: {SIGNING_KEY_ENV}={path})", highlight=False)
    console.print(f"public key, for every job that loads from the cache:\n  {PUBLIC_KEY_ENV}={public}",
                  highlight=False, soft_wrap=True)


@cache_app.command()
def prune(
    url: UrlArg,
    failed: Annotated[bool, typer.Option("--failed", help="Remove failed and corrupt entries.")] = False,
    older_than_days: Annotated[float | None, typer.Option(help="Remove entries unused for this many days.")] = None,
    other_versions: Annotated[bool, typer.Option(
        "--other-versions", help="Remove trnflow's entries of other compiler versions.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go.")] = False,
    compiler_version: Annotated[str | None, typer.Option(
        help="The version folder to keep, as `cache ls` names it (default: this torch's).")] = None,
    as_json: JsonOpt = False,
):
    """Remove failed entries, old ones, or other compiler versions' (never one being compiled). Of the
    Neuron compiler's own entries only failed ones go: their age and version are its tools' to manage."""

    if not (failed or older_than_days is not None or other_versions):
        err.print("[red]say what to prune: --failed, --older-than-days N or --other-versions[/red]")
        raise typer.Exit(ExitCode.BAD_INPUT)
    with _cache(url) as cache:
        removed = cache.prune(compiler_version or COMPILER_VERSION, failed=failed, older_than_days=older_than_days,
                              other_versions=other_versions, dry_run=dry_run)
    if as_json:
        print(json.dumps({"removed": [e.as_dict() for e in removed], "dry_run": dry_run}, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for e in removed:
        console.print(f"{verb} {shown(e.compiler)}/{shown(e.key)} ({e.state})", highlight=False)
    console.print(f"{len(removed)} entr{'y' if len(removed) == 1 else 'ies'} {verb}")
