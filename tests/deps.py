"""The locks: the exact set of packages the suite last passed with, one file per environment.

    python -m tests.deps verify .venv/bin/python requirements/lock.txt   # installed == locked, or exit 1
    python -m tests.deps write .venv/bin/python requirements/lock.txt    # the lock from what is installed
    python -m tests.deps behind .venv/bin/python requirements/lock.txt   # locked against the registry's newest

A lock is `pip freeze` of an environment (without the editable installs: trnflow and the example
recipe), under a header, and `make install` installs with it as pip's constraints, so a release
on the registry changes nothing until `make deps-update` has run the suite on it. pyproject.toml
keeps the ranges users install from. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HEADER = """\
# The versions `make test` last passed with in {env}: its pip freeze, less the editable installs.
# `make install` installs within them (pip's constraints); pyproject.toml keeps the ranges users get.
# Written by `make deps-update` (which resolves afresh and writes only when the suite passes);
# `make deps-check` says how far it is behind the registry. Do not edit by hand.
"""


def key(requirement: str) -> str:
    """A requirement's project name, normalised as pip compares them."""
    return requirement.split("==", 1)[0].strip().lower().replace("_", "-").replace(".", "-")


def pinned(lines: list[str]) -> dict[str, str]:
    """name -> version of every `name==version` line; comments and blank lines are skipped."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line and "==" in line:
            found[key(line)] = line.split("==", 1)[1].strip()
    return found


def installed(python: str) -> list[str]:
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], check=True, text=True,
                            capture_output=True).stdout
    return [line for line in frozen.splitlines() if line.strip() and not line.startswith("-e ")]


def differences(locked: dict[str, str], have: dict[str, str]) -> list[str]:
    out = []
    for name in sorted(locked.keys() | have.keys()):
        if name not in have:
            out.append(f"{name}: locked {locked[name]}, not installed")
        elif name not in locked:
            out.append(f"{name}: {have[name]} installed, not in the lock")
        elif locked[name] != have[name]:
            out.append(f"{name}: locked {locked[name]}, installed {have[name]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.deps", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("verify", "write", "behind"))
    parser.add_argument("python", help="The environment's Python (e.g. .venv/bin/python).")
    parser.add_argument("lock", type=Path)
    parser.add_argument("--name", help="What the lock's header calls the environment (default: its folder).")
    args = parser.parse_args(argv)

    if args.command == "write":
        env = args.name or str(Path(args.python).parent.parent)
        args.lock.parent.mkdir(parents=True, exist_ok=True)
        partial = args.lock.with_name(args.lock.name + ".partial")
        partial.write_text(HEADER.format(env=env) + "\n".join(sorted(installed(args.python), key=key)) + "\n")
        partial.replace(args.lock)
        print(f"{args.lock}: {len(pinned(args.lock.read_text().splitlines()))} packages")
        return 0

    if not args.lock.is_file():
        print(f"{args.lock}: no such lock; `make deps-update` writes it", file=sys.stderr)
        return 1
    locked = pinned(args.lock.read_text().splitlines())

    if args.command == "verify":
        problems = differences(locked, pinned(installed(args.python)))
        if problems:
            print(f"{args.python}'s packages differ from {args.lock}:\n  " + "\n  ".join(problems)
                  + "\nReinstall it from the lock (remove its environment and run `make install`), or run "
                  "`make deps-update` to move the lock.", file=sys.stderr)
            return 1
        print(f"{args.python}: {len(locked)} packages, as {args.lock} locks them")
        return 0

    report = subprocess.run([args.python, "-m", "pip", "list", "--outdated", "--format", "json"], check=True,
                            text=True, capture_output=True).stdout
    newer = {key(row["name"]): row["latest_version"] for row in json.loads(report or "[]")}
    behind = sorted(name for name in newer if name in locked and newer[name] != locked[name])
    print(f"{args.lock}: {len(behind)} of {len(locked)} locked packages have a newer release")
    for name in behind:
        print(f"  {name:<32} {locked[name]:>14} -> {newer[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
