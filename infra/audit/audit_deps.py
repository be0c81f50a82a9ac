"""Audit the installed dependencies against the vulnerability records PyPI publishes.

    python infra/audit/audit_deps.py [--json]

For each installed distribution (the project itself excepted) it asks PyPI's JSON API for the
vulnerabilities of that exact version. Where the per-version document cannot be had, the project
document still lists the vulnerabilities of the newest release, which is exact for a package
installed at its newest version. A package below its newest release whose own version cannot be
looked up is reported as unverified, with the newest version, and does not fail the audit.

Exit 1 on a vulnerability not listed in `ignored.txt` beside this file (one `ID  reason` a line),
0 otherwise. With PyPI unreachable it says so and exits 0: the audit needs the registry.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

PYPI = "https://pypi.org/pypi"
LOCAL = {"trnflow"}
IGNORED = Path(__file__).with_name("ignored.txt")


@dataclass
class Finding:
    name: str
    version: str
    checked: str
    """`exact` (the version's own record), `newest` (installed at the newest release), `unverified`, `error`."""
    vulns: list[dict] = field(default_factory=list)
    newest: str | None = None


def _get(url: str) -> dict | None:
    """The JSON document at `url`; None when PyPI has no such document (404)."""
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:  # noqa: S310 (https://pypi.org only)
            return json.load(answer)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def check(name: str, version: str, get=_get) -> Finding:
    exact = get(f"{PYPI}/{name}/{version}/json")
    if exact is not None:
        return Finding(name, version, "exact", exact.get("vulnerabilities") or [])
    project = get(f"{PYPI}/{name}/json")
    if project is None:
        return Finding(name, version, "unverified")
    newest = project["info"]["version"]
    if _public(version) == newest:
        return Finding(name, version, "newest", project.get("vulnerabilities") or [], newest)
    return Finding(name, version, "unverified", newest=newest)


def _public(version: str) -> str:
    return version.split("+", 1)[0]  # torch 2.x.y+cpu is torch 2.x.y on PyPI


def ignored(path: Path = IGNORED) -> dict[str, str]:
    """Vulnerability ids accepted on purpose, each with its reason."""
    out = {}
    for number, line in enumerate(path.read_text().splitlines() if path.exists() else [], start=1):
        line = line.split("#", 1)[0].strip()
        if line:
            vuln, *reason = line.split(None, 1)
            if not reason:
                raise ValueError(f"{path.name} line {number}: {vuln} has no reason; say why it is accepted")
            out[vuln] = reason[0]
    return out


def open_vulns(findings: list[Finding], accepted: dict[str, str]) -> list[tuple[Finding, dict]]:
    """The vulnerabilities found whose id (or an alias) is not accepted."""
    return [(f, v) for f in findings for v in f.vulns
            if not ({v.get("id"), *(v.get("aliases") or [])} & set(accepted))]


def main(argv: list[str]) -> int:
    installed = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions()}
    names = sorted(set(installed) - LOCAL)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = {pool.submit(check, n, installed[n]): n for n in names}
        findings = []
        for future in concurrent.futures.as_completed(futures):
            name = futures[future]
            try:
                findings.append(future.result())
            except (OSError, ValueError) as exc:
                findings.append(Finding(name, installed[name], "error", newest=str(exc)))
    findings.sort(key=lambda f: f.name)
    by = {kind: [f for f in findings if f.checked == kind] for kind in ("exact", "newest", "unverified", "error")}
    if len(by["error"]) == len(findings):
        print(f"dependency audit: PyPI could not be reached ({by['error'][0].newest}); nothing was audited")
        return 0
    problems = open_vulns(findings, ignored())
    if "--json" in argv:
        print(json.dumps({k: [f.__dict__ for f in v] for k, v in by.items()}, indent=1))
    for f, v in problems:
        print(f"VULNERABLE {f.name} {f.version}: {v.get('id')} {v.get('aliases') or ''} fixed in "
              f"{', '.join(v.get('fixed_in') or []) or 'no release yet'}; upgrade it, or accept it in "
              f"{IGNORED.name} with the reason")
    if by["unverified"] or by["error"]:
        held = ", ".join(f"{f.name} {f.version} (newest {f.newest})" for f in by["unverified"] + by["error"])
        print(f"unverified (no record for the installed version): {held}")
    print(f"dependency audit: {len(by['exact'])} checked at their version, {len(by['newest'])} at the newest "
          f"release, {len(by['unverified']) + len(by['error'])} unverified; {len(problems)} open vulnerabilities")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
