"""Signed compile-cache entries: who may put code into every later job.

An entry's artifact is code (at optlevel 2 and 3 it holds TorchInductor's cache, whose records are
unpickled when a job loads them), and its checksums (`trnflow.json`) sit in the same store, so whoever
can write the cache can rewrite both. Where a cache is shared, the compile stage therefore signs each
entry's record with an Ed25519 key that no other job holds, and every job verifies with the public
key alone: an entry that is unsigned, signed by another key, or moved to another entry's place is
not loaded (a miss, reported with why), and the compile stage compiles it again.

- `TRNFLOW_CACHE_SIGNING_KEY`: the private key, for the compile stage only: a PEM file, or the ARN
  of a Secrets Manager secret holding the PEM text (which only the compile stage's role can read).
- `TRNFLOW_CACHE_PUBLIC_KEY`: the public key every job verifies with, as `trnflow cache keygen`
  prints it (`ed25519:<base64>`) or a PEM file. Not a secret.

With neither set, entries are neither signed nor checked: a cache only its owner can write (a local
folder, which trnflow refuses when another user owns it or others can write it) needs no more. A
shared cache (on S3) is refused without a public key (`shared_cache_problem`), unless
`TRNFLOW_CACHE_UNSIGNED=1` says to use it unsigned, which every run that does so says in its log
and summary.

The compile stage runs the recipe's code (it traces the model) in the process that holds the
signing key, so a recipe can sign what it likes: signing keeps every other job, and anyone who can
write the bucket, from putting code into the cache, not the recipes the compile stage runs.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from trnflow import aws
from trnflow.errors import FatalError

SIGNING_KEY_ENV = "TRNFLOW_CACHE_SIGNING_KEY"
PUBLIC_KEY_ENV = "TRNFLOW_CACHE_PUBLIC_KEY"
UNSIGNED_ENV = "TRNFLOW_CACHE_UNSIGNED"
"""`1`: use a shared (S3) cache whose entries are not signed, the documented opt-out."""
PREFIX = "ed25519:"


@dataclass(frozen=True)
class EntryKeys:
    """The keys a process holds for the cache: `signer` in the compile stage, `trusted` everywhere a
    cache is shared. Neither: entries are not signed or checked."""

    signer: Ed25519PrivateKey | None = None
    trusted: Ed25519PublicKey | None = None
    unsigned_ok: bool = False
    """TRNFLOW_CACHE_UNSIGNED: a shared cache may be used without a key."""

    @property
    def checks(self) -> bool:
        return self.trusted is not None

    def sign(self, data: bytes) -> bytes:
        if self.signer is None:
            raise FatalError(f"this process holds no cache signing key ({SIGNING_KEY_ENV}), and the cache takes "
                             f"only signed entries ({PUBLIC_KEY_ENV} is set): only the compile stage writes it")
        return self.signer.sign(data)

    def verifies(self, data: bytes, signature: bytes) -> bool:
        if self.trusted is None:
            return True
        try:
            self.trusted.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def public_text(key: Ed25519PublicKey) -> str:
    """`ed25519:<base64 of the raw key>`, as TRNFLOW_CACHE_PUBLIC_KEY takes it."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PREFIX + base64.b64encode(raw).decode()


def generate(path: Path) -> str:
    """Write a new private key to `path` (PEM, readable by its owner only) and return its public text."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as out:
        out.write(pem)
    return public_text(key.public_key())


def _private(value: str) -> Ed25519PrivateKey:
    if value.startswith("arn:aws:secretsmanager:"):
        from botocore.exceptions import BotoCoreError, ClientError  # botocore: loaded with boto3 only here

        try:
            pem = aws.client("secretsmanager").get_secret_value(SecretId=value)["SecretString"].encode()
        except (BotoCoreError, ClientError) as exc:
            raise FatalError(f"{SIGNING_KEY_ENV}: the secret {value} cannot be read ({exc}); only the compile "
                             "stage's role may read it") from None
    else:
        path = Path(value).expanduser()
        try:
            mode = path.stat().st_mode
            if mode & 0o077:  # as ssh refuses a private key others can read
                raise FatalError(f"{SIGNING_KEY_ENV}: {path} can be read by other users (mode {mode & 0o777:o}): "
                                 f"whoever reads it can sign cache entries every job runs; `chmod 600 {path}`")
            pem = path.read_bytes()
        except OSError as exc:
            raise FatalError(f"{SIGNING_KEY_ENV}: {value}: {exc.strerror}; give the PEM file `trnflow cache "
                             "keygen` wrote, or a Secrets Manager secret's ARN") from None
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise FatalError(f"{SIGNING_KEY_ENV}: {value} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise FatalError(f"{SIGNING_KEY_ENV}: {value} is not an Ed25519 key; make one with `trnflow cache keygen`")
    return key


def public_key(value: str) -> Ed25519PublicKey:
    """The public key `value` gives (`ed25519:<base64>`, or a PEM file); FatalError naming the
    setting when it gives none."""
    value = value.strip()
    try:
        if value.startswith(PREFIX):
            return Ed25519PublicKey.from_public_bytes(base64.b64decode(value[len(PREFIX):], validate=True))
        key = serialization.load_pem_public_key(Path(value).expanduser().read_bytes())
    except OSError as exc:
        raise FatalError(f"{PUBLIC_KEY_ENV}: {value}: {exc.strerror}; give `ed25519:<base64>` as "
                         "`trnflow cache keygen` prints it, or a PEM file") from None
    except ValueError as exc:
        raise FatalError(f"{PUBLIC_KEY_ENV}: not an Ed25519 public key ({exc}); give `ed25519:<base64>` as "
                         "`trnflow cache keygen` prints it") from None
    if not isinstance(key, Ed25519PublicKey):
        raise FatalError(f"{PUBLIC_KEY_ENV}: {value} is not an Ed25519 public key")
    return key


def keys_from(env: Mapping[str, str] | None = None) -> EntryKeys:
    """The keys the environment gives. A signing key alone also verifies (with its public half)."""
    env = os.environ if env is None else env
    signer = _private(env[SIGNING_KEY_ENV]) if env.get(SIGNING_KEY_ENV) else None
    trusted = public_key(env[PUBLIC_KEY_ENV]) if env.get(PUBLIC_KEY_ENV) else None
    if signer is not None and trusted is None:
        trusted = signer.public_key()
    elif signer is not None and trusted is not None and public_text(signer.public_key()) != public_text(trusted):
        raise FatalError(f"{SIGNING_KEY_ENV} and {PUBLIC_KEY_ENV} are not one key pair: entries signed here would "
                         "not verify anywhere; set the public key the signing key's `trnflow cache keygen` printed")
    return EntryKeys(signer, trusted, unsigned_ok=unsigned_opt_out(env))


def unsigned_opt_out(env: Mapping[str, str]) -> bool:
    """Whether TRNFLOW_CACHE_UNSIGNED says to use a shared cache unsigned (`1`, `true` or `yes`)."""
    return env.get(UNSIGNED_ENV, "").strip().lower() in ("1", "true", "yes")


def shared_cache_problem(url: str, checks: bool, unsigned_ok: bool) -> str | None:
    """Why a cache at `url` may not be used with these keys, or None: a shared cache (S3) holds code
    every job that loads it runs, written by whoever can write the bucket, so it is used only with a
    public key that checks its entries (`checks`), or with the opt-out (`unsigned_ok`)."""
    if not url.startswith("s3://") or checks or unsigned_ok:
        return None
    return (f"compile.cache_url {url} is shared, and nothing checks its entries: what it holds runs in every job "
            f"that loads it. Set {PUBLIC_KEY_ENV} (the stack's CachePublicKey, as `trnflow cache keygen` prints "
            f"it), or set {UNSIGNED_ENV}=1 to use it unsigned (each run then says so)")
