"""Keys: the KMS-client interface every encrypted or signed file goes through, and its two sources.

A key reference (KEYREF) names where the keys live: `file:PATH` is a keyring that
`petatrain keys create PATH` wrote; `barbican+https://HOST:PORT/v1/containers/ID` is a key
container in OpenStack Barbican, a key manager reached over HTTP (`security/barbican.py`), that
`petatrain keys create barbican+https://HOST:PORT` made. Data is never
encrypted with the master key itself: each file gets a fresh data key, and only the
*wrapped* data key (encrypted by a master key version, bound to what it protects) is
stored beside the data. Rotating adds a master version and re-wraps those small records;
the data stays as it is.

The keyring (JSON, mode 0600, refused when group or others may read it):

    {"format": 1, "kind": "petatrain-keyring",
     "master": {"1": "<base64 of 32 bytes>", ...}, "primary": 1,
     "signing": {"private": "<base64 Ed25519 seed>", "public": "<base64 Ed25519 public key>"}}

A wrapped key is "v<version>:<base64url(nonce || AES-256-GCM(master[version], key))>",
the associated data being "petatrain-wrap/1" and the context it was wrapped for, so a wrapped
key moved to another file's record does not unwrap. Signatures are Ed25519 over the exact
bytes of a record (`sign`/`verify`); a keyring written by `keys public` holds only the public
half and can verify but not sign or decrypt.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import secrets
import stat
import threading
import time
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from petatrain.errors import ConfigError, PetatrainError
from petatrain.security.protection import Protected, Protection, protection_of

FORMAT = 1
KEYRING = "petatrain-keyring"
PUBLIC = "petatrain-verify-key"
_WRAP_AAD = b"petatrain-wrap/1\0"
_NONCE = 12


class KeyringError(PetatrainError):
    """A key reference that cannot be used: missing, unreadable, loose permissions, wrong key."""


class KmsClient(Protocol):
    """What encryption and signing need from a key service. `ref` is the KEYREF, for errors."""

    ref: str

    @property
    def primary(self) -> int:
        """The master key version new data keys are wrapped with."""
        ...

    def wrap(self, key: bytes, context: str) -> str: ...

    def unwrap(self, wrapped: str, context: str) -> bytes: ...

    @property
    def can_sign(self) -> bool: ...

    @property
    def key_id(self) -> str:
        """The signing key's public fingerprint, recorded beside each signature."""
        ...

    def sign(self, data: bytes) -> str: ...

    def verify(self, data: bytes, signature: str) -> bool: ...


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: Any, what: str, where: str) -> bytes:
    if not isinstance(text, str):
        raise KeyringError(f"keyring {where}: {what} is not a base64 string")
    try:
        return base64.b64decode(text.encode(), validate=True)
    except (binascii.Error, ValueError):
        raise KeyringError(f"keyring {where}: {what} is not valid base64") from None


def fingerprint(public: bytes) -> str:
    return "ed25519:" + hashlib.sha256(public).hexdigest()[:16]


class SecretKeys:
    """Master key versions (to wrap data keys) and an Ed25519 pair (to sign), held in memory.

    What a keyring file and a Barbican container both come to; `label` names the source in errors."""

    def __init__(self, ref: str, label: str, master: dict[int, bytes], public: Ed25519PublicKey,
                 signer: Ed25519PrivateKey | None = None, primary: int = 0):  # fmt: skip
        self.ref = ref
        self.label = label
        self._master = {version: AESGCM(raw) for version, raw in master.items()}
        self._primary = primary or max(master, default=0)
        self._signer = signer
        self._public = public
        self._public_raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def primary(self) -> int:
        if not self._master:
            raise KeyringError(f"{self.ref} holds only a verification key; it cannot encrypt or decrypt")
        return self._primary

    @property
    def versions(self) -> list[int]:
        return sorted(self._master)

    @property
    def public_raw(self) -> bytes:
        return self._public_raw

    def wrap(self, key: bytes, context: str) -> str:
        version = self.primary
        nonce = secrets.token_bytes(_NONCE)
        sealed = self._master[version].encrypt(nonce, key, _WRAP_AAD + context.encode())
        return f"v{version}:" + base64.urlsafe_b64encode(nonce + sealed).decode()

    def unwrap(self, wrapped: str, context: str) -> bytes:
        if not self._master:
            raise KeyringError(f"{self.ref} holds only a verification key; it cannot decrypt {context}")
        version, blob = _split_wrapped(wrapped, context)
        master = self._master.get(version)
        if master is None:
            held = ", ".join(str(v) for v in self.versions)
            raise KeyringError(
                f"{context} is encrypted with master key version {version}, which {self.label} {self.ref} does not "
                f"hold (it holds {held}): wrong keys, or the version was retired"
            )
        try:
            return master.decrypt(blob[:_NONCE], blob[_NONCE:], _WRAP_AAD + context.encode())
        except InvalidTag:
            raise KeyringError(
                f"the data key of {context} does not unwrap with {self.label} {self.ref} (version {version}): "
                "other keys, or a record moved from another file"
            ) from None

    @property
    def can_sign(self) -> bool:
        return self._signer is not None

    @property
    def key_id(self) -> str:
        return fingerprint(self._public_raw)

    def sign(self, data: bytes) -> str:
        if self._signer is None:
            raise KeyringError(f"{self.ref} holds only a verification key; it cannot sign")
        return _b64(self._signer.sign(data))

    def verify(self, data: bytes, signature: str) -> bool:
        try:
            self._public.verify(base64.b64decode(signature.encode(), validate=True), data)
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True


class LocalKeyring(SecretKeys):
    """The keyring file `keys create` writes: master key versions and an Ed25519 pair."""

    def __init__(self, path: str, record: dict[str, Any]):
        self.path = path
        ref = f"file:{path}"
        master: dict[int, bytes] = {}
        primary = 0
        signer: Ed25519PrivateKey | None = None
        if record.get("kind") == KEYRING:
            found = record.get("master")
            if not isinstance(found, dict) or not found:
                raise KeyringError(f"keyring {ref}: no master keys")
            for version, text in found.items():
                raw = _unb64(text, f"master key {version}", ref)
                if not str(version).isdigit() or len(raw) != 32:
                    raise KeyringError(f"keyring {ref}: master key {version!r} is not a 256-bit key version")
                master[int(version)] = raw
            given = record.get("primary")
            if type(given) is not int or given not in master:
                raise KeyringError(f"keyring {ref}: primary {given!r} is not one of its master key versions")
            primary = given
            signing = record.get("signing") or {}
            seed = _unb64(signing.get("private"), "signing key", ref)
            try:
                signer = Ed25519PrivateKey.from_private_bytes(seed)
            except ValueError:
                raise KeyringError(f"keyring {ref}: the signing key is not an Ed25519 key") from None
            public = signer.public_key()
        else:
            raw = _unb64(record.get("public"), "public key", ref)
            try:
                public = Ed25519PublicKey.from_public_bytes(raw)
            except ValueError:
                raise KeyringError(f"keyring {ref}: the public key is not an Ed25519 key") from None
        super().__init__(ref, "keyring", master, public, signer, primary)


class BarbicanKeys(SecretKeys):
    """A Barbican key container (`security/barbican.py`): its keys fetched once, held in memory.

    A version this process has not seen (rotated by another process since) is fetched again once."""

    def __init__(self, keyref: str, credentials: Any):
        self.credentials = credentials
        master, seed = _barbican_call(lambda b: b.fetch(keyref, credentials))
        try:
            signer = Ed25519PrivateKey.from_private_bytes(seed) if seed is not None else None
        except ValueError:
            raise KeyringError(f"key container {keyref}: its signing secret is not an Ed25519 seed") from None
        if signer is None:
            raise KeyringError(f"key container {keyref} holds no signing secret; it is not a petatrain key container")
        super().__init__(keyref, "key container", master, signer.public_key(), signer)

    def unwrap(self, wrapped: str, context: str) -> bytes:
        version, _ = _split_wrapped(wrapped, context)
        if version not in self._master:
            fresh = BarbicanKeys(self.ref, self.credentials)
            self._master, self._primary = fresh._master, fresh._primary
        return super().unwrap(wrapped, context)


def _barbican_call(call: Any) -> Any:
    from petatrain.security import barbican

    try:
        return call(barbican)
    except barbican.BarbicanError as exc:
        raise KeyringError(str(exc)) from None


def _split_wrapped(wrapped: Any, context: str) -> tuple[int, bytes]:
    if isinstance(wrapped, str) and wrapped.startswith("v") and ":" in wrapped:
        version, _, text = wrapped[1:].partition(":")
        if version.isdigit():
            try:
                blob = base64.urlsafe_b64decode(text.encode())
            except (binascii.Error, ValueError):
                blob = b""
            if len(blob) > _NONCE + 16:
                return int(version), blob
    raise KeyringError(f"the wrapped data key recorded for {context} is malformed (expected v<N>:<base64>)")


# ---- keyring files ------------------------------------------------------------------------------


def _is_barbican(keyref: str) -> bool:
    return keyref.startswith("barbican+")


def _path_of(keyref: str) -> str:
    scheme, sep, rest = keyref.partition(":")
    if not sep or not rest:
        raise KeyringError(f"key reference {keyref!r} is not file:PATH or a KMS URL (barbican+https://...)")
    if scheme == "file":
        return os.path.abspath(os.path.expanduser(rest))
    raise KeyringError(
        f"key reference {keyref!r}: no KMS client for '{scheme}:' in this petatrain; use a keyring "
        "file (file:PATH from `petatrain keys create PATH`) or Barbican (barbican+https://HOST:PORT/v1/containers/ID)"
    )


def check_keyref(keyref: str, what: str) -> None:
    """ConfigError naming `what` (a config key) unless `keyref` has a form petatrain can use."""
    try:
        if _is_barbican(keyref):
            _barbican_call(lambda b: b.parse(keyref))
        else:
            _path_of(keyref)
    except KeyringError as exc:
        raise ConfigError(f"{what}: {exc}") from None


_cache: dict[tuple[str, int, int, int, int, int], LocalKeyring] = {}
_remote: dict[str, BarbicanKeys] = {}
_cache_lock = threading.Lock()


def open_keys(keyref: str, credentials: Any = None) -> KmsClient:
    """The key service KEYREF names, one-line errors. A keyring file is read once per change; a
    Barbican container once per process, with `credentials` (a job's `Protection.kms_credentials`),
    else those it was first opened with, else OS_AUTH_TOKEN / OS_PROJECT_ID."""
    if _is_barbican(keyref):
        return _open_barbican(keyref, credentials)
    path = _path_of(keyref)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise KeyringError(f"keyring {keyref} does not exist (create one with `petatrain keys create PATH`)") from None
    except OSError as exc:
        raise KeyringError(f"keyring {keyref} cannot be read: {exc.strerror}") from None
    key = (path, info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size, info.st_mode)
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None:
        return cached
    record = _read_record(path, keyref, info)
    ring = LocalKeyring(path, record)
    with _cache_lock:
        _cache[key] = ring
    return ring


def _open_barbican(keyref: str, credentials: Any) -> BarbicanKeys:
    with _cache_lock:
        cached = _remote.get(keyref)
    if cached is not None and (credentials is None or not credentials.given or credentials == cached.credentials):
        return cached
    if credentials is None or not credentials.given:
        credentials = _barbican_call(lambda b: b.Credentials.from_env())
    opened = BarbicanKeys(keyref, credentials)
    with _cache_lock:
        _remote[keyref] = opened
    return opened


def _forget(keyref: str) -> None:
    with _cache_lock:
        _remote.pop(keyref, None)


def _read_record(path: str, keyref: str, info: os.stat_result) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            raw = handle.read(1 << 20)
    except OSError as exc:
        raise KeyringError(f"keyring {keyref} cannot be read: {exc.strerror}") from None
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise KeyringError(f"keyring {keyref} is not a petatrain keyring (not JSON)") from None
    if not isinstance(record, dict) or record.get("kind") not in (KEYRING, PUBLIC):
        raise KeyringError(f"keyring {keyref} is not a petatrain keyring")
    if record.get("format") != FORMAT:
        raise KeyringError(f"keyring {keyref} has format {record.get('format')!r}; this petatrain reads {FORMAT}")
    if record["kind"] == KEYRING and info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyringError(
            f"keyring {keyref} may be read by group or others (mode {stat.S_IMODE(info.st_mode):o}); "
            f"run `chmod 600 {path}`"
        )
    return record


def _write_private(path: str, record: dict[str, Any], *, replace: bool) -> None:
    """Write a keyring as 0600 from its first byte: a new file, then a rename over the old one."""
    folder = os.path.dirname(path) or "."
    _make_private_folder(folder)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        if not replace and os.path.exists(path):
            raise KeyringError(f"{path} exists; a keyring is never overwritten (choose another path)")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _make_private_folder(folder: str) -> None:
    """`folder` and the parents it lacks, 0700 whatever the umask (under `umask 000` makedirs gives 0777:
    anyone could swap the keyring's file in it); an existing folder is left as it is."""
    missing = []
    while folder and not os.path.isdir(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    for made in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(made, 0o700)
            os.chmod(made, 0o700)  # mkdir's mode is masked by the umask; this is not


def create_keyring(path: str) -> SecretKeys:
    """New keys at `path` (never over an existing file): master key version 1 and a signing pair.
    `path` is a file, or a Barbican service URL (barbican+https://HOST:PORT): a new container there."""
    if _is_barbican(path):
        credentials = _barbican_call(lambda b: b.Credentials.from_env())
        keyref = _barbican_call(lambda b: b.create(path, credentials))
        return _open_barbican(keyref, credentials)
    path = path.removeprefix("file:")  # the KEYREF form names the same file
    if "://" in path:
        raise KeyringError(
            f"{path!r} is neither a keyring file's path nor a Barbican service (barbican+https://HOST:PORT)"
        )
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path):
        raise KeyringError(f"{path} exists; a keyring is never overwritten (choose another path)")
    signer = Ed25519PrivateKey.generate()
    record = {
        "format": FORMAT,
        "kind": KEYRING,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "master": {"1": _b64(AESGCM.generate_key(bit_length=256))},
        "primary": 1,
        "signing": {
            "private": _b64(signer.private_bytes_raw()),
            "public": _b64(signer.public_key().public_bytes_raw()),
        },
    }
    _write_private(path, record, replace=False)
    ring = open_keys(f"file:{path}")
    assert isinstance(ring, LocalKeyring)
    return ring


def add_master_version(keyref: str) -> int:
    """Rotate: a new master key version becomes primary (old ones stay, to unwrap); its number."""
    if _is_barbican(keyref):
        keys = _open_barbican(keyref, None)
        version = _barbican_call(lambda b: b.add_version(keyref, keys.credentials))
        _forget(keyref)
        return int(version)
    path = _path_of(keyref)
    record = _read_record(path, keyref, os.stat(path))
    if record["kind"] != KEYRING:
        raise KeyringError(f"{keyref} holds only a verification key; rotate the keyring it came from")
    LocalKeyring(path, record)  # checked before it is changed
    version = max(int(v) for v in record["master"]) + 1
    record["master"][str(version)] = _b64(AESGCM.generate_key(bit_length=256))
    record["primary"] = version
    _write_private(path, record, replace=True)
    return version


def rotated_targets(keyref: str) -> list[str]:
    """The datasets and runs earlier rotations of this keyring re-wrapped (a local keyring records
    them; a Barbican container keeps no such list: [])."""
    if _is_barbican(keyref):
        return []
    path = _path_of(keyref)
    targets = _read_record(path, keyref, os.stat(path)).get("targets") or []
    return [str(t) for t in targets]


def record_targets(keyref: str, targets: list[str]) -> None:
    """Add `targets` (URLs, nothing secret) to what the local keyring records its rotations re-wrapped."""
    if _is_barbican(keyref) or not targets:
        return
    path = _path_of(keyref)
    record = _read_record(path, keyref, os.stat(path))
    record["targets"] = sorted({*(record.get("targets") or []), *targets})
    _write_private(path, record, replace=True)


def retire_versions(keyref: str, keep: int) -> list[int]:
    """Drop every master key version but `keep` (after all data keys were re-wrapped); the dropped."""
    if _is_barbican(keyref):
        keys = _open_barbican(keyref, None)
        dropped = _barbican_call(lambda b: b.retire(keyref, keep, keys.credentials))
        _forget(keyref)
        return list(dropped)
    path = _path_of(keyref)
    record = _read_record(path, keyref, os.stat(path))
    dropped = sorted(int(v) for v in record["master"] if int(v) != keep)
    record["master"] = {str(keep): record["master"][str(keep)]}
    record["primary"] = keep
    _write_private(path, record, replace=True)
    return dropped


def export_public(keyref: str, out: str) -> str:
    """Write the verification half of the keys (mode 0644: it is not secret); its key id."""
    ring = open_keys(keyref)
    if not isinstance(ring, SecretKeys):
        raise KeyringError(f"{keyref}: these keys export no public key")
    record = {"format": FORMAT, "kind": PUBLIC, "public": _b64(ring.public_raw), "key_id": ring.key_id}
    out = os.path.abspath(os.path.expanduser(out))
    try:  # 0644 whatever the umask (never 0666: anyone could replace what verifiers trust)
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        raise KeyringError(f"{out} exists; choose another path") from None
    os.fchmod(fd, 0o644)
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=1)
    return ring.key_id


def encryption_keys(holder: Protected | Protection | None) -> KmsClient | None:
    """The keys `storage.encryption.key` names, or None when nothing is encrypted."""
    protection = protection_of(holder)
    ref = protection.encryption_key
    return open_keys(ref, protection.kms_credentials) if ref else None


def signing_keys(holder: Protected | Protection | None) -> KmsClient | None:
    """The keys that sign and verify (`storage.signing.key`, else the encryption keyring), or None."""
    protection = protection_of(holder)
    ref = protection.signing_key
    return open_keys(ref, protection.kms_credentials) if ref else None
