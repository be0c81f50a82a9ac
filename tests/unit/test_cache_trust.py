"""Who can put code into every later job through the compile cache: only the compile stage.

An emulator entry's artifact holds TorchInductor's cache, whose records a job unpickles when it
loads them. The attack: compile honestly, swap a pickle in the artifact for one that runs a command,
repack it and rewrite its checksums (trnflow.json sits in the same store). Signed entries stop it;
a local cache folder another user owns, or others can write, is refused outright."""

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trnflow.cli.app import app
from trnflow.device.cache import CORRUPT, DONE, RECORD, SIGNATURE, CompileCache, entry_name, sha256
from trnflow.device.signing import PUBLIC_KEY_ENV, SIGNING_KEY_ENV, generate, keys_from
from trnflow.emulator.compiler import unpack_into
from trnflow.errors import FatalError
from trnflow.safetar import pack
from trnflow.specs import JobSpec

JOB = """
import sys, torch
from pathlib import Path
from trnflow.device.base import RecompileGuard
from trnflow.device.cache import CompileCache, entry_name
from trnflow.device.signing import keys_from
from trnflow.emulator.compiler import compile_flags
from trnflow.emulator.jit import CachedCompiler
from trnflow.safetar import pack

mode, cache_url, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU())
flags = compile_flags(2, "fp32")
cache = CompileCache(cache_url, keys=keys_from())
compiler = CachedCompiler(flags, cache if mode == "run" else None, mode=mode, inductor_dir=work)
try:
    with torch.no_grad():
        torch.compile(model, backend=compiler, fullgraph=True, dynamic=False)(torch.ones(2, 3))
except Exception as exc:  # what a poisoned record does after its payload ran is no concern here
    print("- raised", "|", type(exc).__name__)
    raise SystemExit(0)
seen = compiler.seen[0]
if mode == "compile":
    cache.commit(entry_name(seen.key), seen.graph.canonical(), flags, pack(work))
print(seen.key, seen.outcome, "|", seen.reason)
"""


def _job(mode: str, cache: Path, work: Path, env: dict[str, str]) -> list[str]:
    """One process of a job on the emulator at optlevel 2 (Inductor): `compile` files the graph in the
    cache, `run` loads it from there; what it printed last: key, outcome, reason."""
    done = subprocess.run([sys.executable, "-c", JOB, mode, str(cache), str(work)], capture_output=True, text=True,
                          env={**os.environ, **env, "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "0"}, timeout=600)
    assert done.returncode == 0, (mode, done.stdout[-2000:], done.stderr[-3000:])
    key, outcome, reason = done.stdout.strip().splitlines()[-1].split(" ", 2)
    return [key, outcome, reason.removeprefix("| ")]


class Payload:
    """Unpickled, it runs a command: what an attacker puts in the artifact."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _poison(cache: Path, entry: str, marker: Path) -> int:
    """Swap every pickled Inductor record in the entry's artifact for the payload, repack it and write
    its checksums again, as anyone who can write the store can. How many records were swapped."""
    folder = cache / entry
    work = cache.parent / "poison"
    unpack_into((folder / "model.neff").read_bytes(), work)
    swapped = 0
    for path in work.rglob("*"):
        if path.is_file() and any(part in ("fxgraph", "aotautograd") for part in path.parts):
            path.write_bytes(pickle.dumps(Payload(marker)))
            swapped += 1
    artifact = pack(work)
    (folder / "model.neff").write_bytes(artifact)
    record = json.loads((folder / RECORD).read_text())
    record["files"]["model.neff"] = {"sha256": sha256(artifact), "bytes": len(artifact)}
    (folder / RECORD).write_text(json.dumps(record))
    return swapped


@pytest.mark.slow  # Inductor builds C++ kernels: with the integration tests
def test_a_poisoned_artifact_runs_in_an_unsigned_cache_and_is_refused_in_a_signed_one(tmp_path):
    """Unsigned (as before signing), the poisoned pickle runs in the job that loads the entry. Signed
    by the compile stage, the same poisoning leaves the signature unverified: the job never unpacks the
    entry, compiles the graph itself, says why, and the compile stage's next compile replaces it.
    One compile serves both: an unsigned compile stage writes the same entry without its signature
    (`CompileCache._write_done`; test_only_the_compile_stages_key_makes_entries_others_load holds
    that an unsigned cache writes none)."""
    public = generate(tmp_path / "keys" / "cache.pem")
    job_env = {PUBLIC_KEY_ENV: public}
    signed_cache = tmp_path / "cache-signed"
    key, outcome, _ = _job("compile", signed_cache, tmp_path / "compile",
                           {SIGNING_KEY_ENV: str(tmp_path / "keys" / "cache.pem")})
    entry = entry_name(key)
    assert outcome == "compiled" and (signed_cache / entry / "model.done").exists()
    assert (signed_cache / entry / SIGNATURE).exists()
    assert _job("run", signed_cache, tmp_path / "honest", job_env)[1] == "hit"  # what the compile stage signed
    unsigned_cache = tmp_path / "cache-unsigned"
    shutil.copytree(signed_cache, unsigned_cache)
    (unsigned_cache / entry / SIGNATURE).unlink()

    for signed, cache in ((False, unsigned_cache), (True, signed_cache)):
        marker = tmp_path / f"ran-{signed}"
        assert _poison(cache, entry, marker) > 0
        _, outcome, reason = _job("run", cache, tmp_path / f"run-{signed}", job_env if signed else {})
        if not signed:
            assert marker.exists(), "the poisoned record did not run: the attack this test guards against changed"
            continue
        assert not marker.exists()  # never unpickled
        assert outcome == "recompiled" and "trnflow.sig does not verify" in reason, reason
        verified = CliRunner().invoke(app, ["cache", "verify", str(cache)], env=job_env)
        assert verified.exit_code == 1 and "does not verify" in " ".join(verified.output.split()), verified.output


def _signed_entry(cache: CompileCache, key: str = "MODULE_1+2") -> str:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        data = b"kernel"
        info = tarfile.TarInfo("fx/graph.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    entry = entry_name(key)
    cache.commit(entry, "graph", {"optlevel": 2}, archive.getvalue())
    return entry


def test_only_the_compile_stages_key_makes_entries_others_load(tmp_path):
    """Entries signed with the compile stage's key load; one signed by another key, an unsigned one,
    and a signed one copied into another entry's place are misses that say why. A process without
    the signing key cannot write the cache at all."""
    pem = tmp_path / "compile.pem"
    trusted = {PUBLIC_KEY_ENV: generate(pem)}
    compile_stage = CompileCache(str(tmp_path / "cache"), keys=keys_from({SIGNING_KEY_ENV: str(pem)}))
    job = CompileCache(str(tmp_path / "cache"), keys=keys_from(trusted))
    entry = _signed_entry(compile_stage)
    assert job.state(entry) == DONE and job.load_artifact(entry)

    other = CompileCache(str(tmp_path / "cache"), keys=keys_from({SIGNING_KEY_ENV: str(tmp_path / "o.pem")})) \
        if generate(tmp_path / "o.pem") else None
    forged = _signed_entry(other, "MODULE_3+4")
    unsigned = _signed_entry(CompileCache(str(tmp_path / "cache")), "MODULE_5+6")
    moved = entry_name("MODULE_7+8")
    (tmp_path / "cache" / moved).mkdir(parents=True)
    for name in os.listdir(tmp_path / "cache" / entry):
        (tmp_path / "cache" / moved / name).write_bytes((tmp_path / "cache" / entry / name).read_bytes())
    for bad, why in ((forged, "does not verify"), (unsigned, "is not signed"), (moved, "signed for another entry")):
        assert job.state(bad) == CORRUPT
        assert why in job.signature_problem(bad), job.signature_problem(bad)
        with pytest.raises(Exception, match=why):
            job.load_artifact(bad)
    with pytest.raises(FatalError, match="only the compile stage writes it"):
        _signed_entry(job, "MODULE_9+9")
    assert keys_from({}).checks is False


def test_mismatched_or_malformed_keys_are_one_line_errors(tmp_path):
    pem = tmp_path / "a.pem"
    generate(pem)
    with pytest.raises(FatalError, match="not one key pair"):
        keys_from({SIGNING_KEY_ENV: str(pem), PUBLIC_KEY_ENV: generate(tmp_path / "b.pem")})
    with pytest.raises(FatalError, match=f"{PUBLIC_KEY_ENV}: not an Ed25519 public key"):
        keys_from({PUBLIC_KEY_ENV: "ed25519:AAAA"})
    with pytest.raises(FatalError, match=f"{SIGNING_KEY_ENV}: .*missing.pem"):
        keys_from({SIGNING_KEY_ENV: str(tmp_path / "missing.pem")})
    assert (pem.stat().st_mode & 0o777) == 0o600
    result = CliRunner().invoke(app, ["cache", "keygen", str(pem)])
    assert result.exit_code == 2 and "never overwrites" in " ".join(result.output.split())


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user's takes root")
def test_a_local_cache_folder_of_another_user_or_open_to_all_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(FatalError, match=r"theirs belongs to another user \(uid 65534\)"):
        CompileCache(str(theirs))
    inside = theirs / "mine"  # a folder of another user above: they can swap it
    inside.mkdir()
    with pytest.raises(FatalError, match="belongs to another user"):
        CompileCache(str(inside))
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o1777)
    with pytest.raises(FatalError, match="can be written by every user"):
        CompileCache(str(open_to_all))
    below_sticky = open_to_all / "mine"  # as under /tmp: others cannot rename what is not theirs
    below_sticky.mkdir()
    assert CompileCache(str(below_sticky)).url
    result = CliRunner().invoke(app, ["cache", "ls", str(theirs)])
    assert result.exit_code == 2 and "belongs to another user" in " ".join(result.output.split())


def test_the_default_cache_is_a_folder_of_the_users_own(monkeypatch, tmp_path):
    from tests.conftest import quickstart_data

    data = quickstart_data()
    data["compile"] = {}
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert JobSpec.model_validate(data).compile.cache_url == (tmp_path / "xdg/trnflow/neuron-compile-cache").as_uri()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert JobSpec.model_validate(data).compile.cache_url == (tmp_path / "home/.cache/trnflow/neuron-compile-cache"
                                                              ).as_uri()


@pytest.mark.skipif(os.getuid() != 0, reason="making a folder another user's takes root")
def test_validate_and_run_refuse_a_cache_folder_of_another_user_before_anything_starts(tmp_path):
    from tests.conftest import quickstart_data

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(quickstart_data(compile={"cache_url": str(theirs)})))
    for command in (["validate", str(spec), "--no-data-check"], ["run", str(spec)]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 2, result.output
        said = " ".join(result.output.split())
        assert f"compile.cache_url {theirs.as_uri()}: {theirs} belongs to another user" in said
        assert "Traceback" not in result.output


def test_a_compile_job_reads_its_signing_key_from_secrets_manager(in_process_aws, tmp_path):
    """In the cloud the compile job is given the secret's ARN, never the key: it reads the PEM with
    its role; a secret it cannot read is one line naming the setting."""
    import boto3

    public = generate(tmp_path / "cache.pem")
    arn = boto3.client("secretsmanager").create_secret(
        Name="trnflow-cache-signing-key", SecretString=(tmp_path / "cache.pem").read_text())["ARN"]
    keys = keys_from({SIGNING_KEY_ENV: arn, PUBLIC_KEY_ENV: public})
    assert keys.signer is not None and keys.verifies(b"x", keys.sign(b"x"))
    with pytest.raises(FatalError, match=f"{SIGNING_KEY_ENV}: the secret .* cannot be read"):
        keys_from({SIGNING_KEY_ENV: arn.replace("signing-key", "other")})
