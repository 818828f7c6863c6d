"""Signed records: Ed25519 signatures over the exact bytes of the records that commit data.

A checksum catches accidents; a signature catches someone who rewrites a file *and* its
checksum. Records petatrain signs (a dataset's manifest, a checkpoint's state.json, the final
weights' record) also carry the SHA-256 of every file they cover, since xxh3 is fast but not
made to resist a forger. `{"key_id": "ed25519:…", "ed25519": base64}` sits beside or inside the
record. A reader that holds a key verifies every record it reads and refuses one that is
unsigned or signed by another key; `storage.signing.verify: true` also refuses to read without a key.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from petatrain.errors import CorruptDataError
from petatrain.security.keys import signing_keys
from petatrain.security.protection import Protected, Protection, protection_of

SHA256 = "sha256"


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a record's signature covers: its JSON without the signature, keys sorted."""
    return json.dumps({k: v for k, v in record.items() if k != "signature"}, sort_keys=True).encode()


def signs(holder: Protected | Protection | None) -> bool:
    """Whether records written with this protection are signed (a signing key with its private half)."""
    keys = signing_keys(holder)
    return keys is not None and keys.can_sign


def sign(holder: Protected | Protection | None, data: bytes) -> dict[str, str] | None:
    """The signature of `data` with the configured signing key; None when nothing signs."""
    keys = signing_keys(holder)
    if keys is None or not keys.can_sign:
        return None
    return {"key_id": keys.key_id, "ed25519": keys.sign(data)}


def check(
    holder: Protected | Protection | None,
    data: bytes,
    signature: Any,
    what: str,
    *,
    unsigned_ok: bool = False,
    unsigned_hint: str = "",
) -> bool:
    """Check the signature of a record (`what` names it in errors); True once it verified.

    A reader that holds a key to verify with (`storage.signing.key`, else the encryption keyring)
    verifies, always: a record that is unsigned, or signed by another key, is refused like one
    whose signature does not verify, since stripping a signature or renaming its key is all a
    forger would otherwise need (sigstore and TUF refuse the same); `unsigned_ok` (a dataset the
    config lists in `storage.signing.unsigned`) lets an unsigned record through. Without a key, only
    `storage.signing.verify: true` has something to say: that there is no key to verify with.
    CorruptDataError, one line, in every refusal."""
    verify = protection_of(holder).verify_signatures
    keys = signing_keys(holder)
    if keys is None:
        if verify:
            raise CorruptDataError(
                f"{what}: storage.signing.verify is on but no key is configured to verify with "
                "(set storage.signing.key or storage.encryption.key)"
            )
        if signature is not None and not _well_formed(signature):
            raise CorruptDataError(f"{what}: its signature record is malformed")
        return False
    if signature is None:
        if unsigned_ok:
            return False
        raise CorruptDataError(
            f"{what} is not signed, and this reader holds the key {keys.key_id} ({keys.ref}): it verifies what it "
            f"reads{unsigned_hint}"
        )
    if not _well_formed(signature):
        raise CorruptDataError(f"{what}: its signature record is malformed")
    if signature["key_id"] != keys.key_id:
        raise CorruptDataError(f"{what} is signed by key {signature['key_id']}, not by {keys.key_id} ({keys.ref})")
    if not keys.verify(data, signature["ed25519"]):
        raise CorruptDataError(f"{what}: its signature does not verify (the record was changed after it was signed)")
    return True


def _well_formed(signature: Any) -> bool:
    return isinstance(signature, dict) and all(isinstance(signature.get(k), str) for k in ("key_id", "ed25519"))
