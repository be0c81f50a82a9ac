"""The dependency audit (infra/audit/audit_deps.py): its verdicts, then a live run against PyPI."""

import importlib.util
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

AUDIT = Path(__file__).resolve().parents[1] / "audit" / "audit_deps.py"
spec = importlib.util.spec_from_file_location("audit_deps", AUDIT)
audit = sys.modules["audit_deps"] = importlib.util.module_from_spec(spec)  # a script, not a package
spec.loader.exec_module(audit)

VULN = {"id": "PYSEC-2099-1", "aliases": ["CVE-2099-0001"], "fixed_in": ["2.0.1"]}


def _pypi(documents):
    return lambda url: documents.get(url.removeprefix(f"{audit.PYPI}/"))


def test_each_package_is_checked_at_its_version_or_at_the_newest_release_or_called_unverified():
    get = _pypi({"a/1.0/json": {"vulnerabilities": [VULN]},
                 "b/json": {"info": {"version": "2.0"}, "vulnerabilities": []},
                 "c/json": {"info": {"version": "3.1"}, "vulnerabilities": [VULN]}})
    a, b, c = audit.check("a", "1.0", get), audit.check("b", "2.0+cpu", get), audit.check("c", "3.0", get)
    assert (a.checked, a.vulns) == ("exact", [VULN])
    assert (b.checked, b.vulns) == ("newest", [])  # a local build of the newest release
    assert (c.checked, c.vulns, c.newest) == ("unverified", [], "3.1")  # 3.1's records say nothing of 3.0
    assert audit.open_vulns([a, b, c], {}) == [(a, VULN)]
    assert audit.open_vulns([a], {"CVE-2099-0001": "not reachable from trnflow"}) == []  # accepted by alias


def test_accepted_vulnerabilities_need_a_reason_each(tmp_path):
    listed = tmp_path / "ignored.txt"
    listed.write_text("# comment\nPYSEC-2099-1\tthe parser is never given untrusted input\n\n")
    assert audit.ignored(listed) == {"PYSEC-2099-1": "the parser is never given untrusted input"}
    listed.write_text("GHSA-xxxx-yyyy-zzzz\n")
    with pytest.raises(ValueError, match="line 1: GHSA-xxxx-yyyy-zzzz has no reason"):
        audit.ignored(listed)
    assert audit.ignored(AUDIT.with_name("ignored.txt")) == {}  # none accepted today


def _pypi_reachable() -> bool:
    try:
        urllib.request.urlopen(f"{audit.PYPI}/pip/json", timeout=10).close()  # noqa: S310 (https)
        return True
    except OSError:
        return False


def test_the_installed_dependencies_have_no_open_vulnerability():
    if not _pypi_reachable():
        pytest.skip("PyPI cannot be reached from here: the audit needs its vulnerability records")
    done = subprocess.run([sys.executable, str(AUDIT)], capture_output=True, text=True, timeout=300)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 open vulnerabilities" in done.stdout
