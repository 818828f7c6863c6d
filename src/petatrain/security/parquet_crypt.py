"""Encrypted Parquet: pyarrow's Parquet modular encryption (AES-GCM columns and footer) under a
dataset key, so Spark, pyarrow and anything else holding the key read the shards as they are.

The key hierarchy, each level wrapping the next:

    keyring master key (version N)  ->  dataset key (in the manifest, `DatasetKeys.record`)
        ->  key-encryption keys (in each file's footer, Parquet's double wrapping)
            ->  data keys (per file and column, Parquet's own)

The dataset key is petatrain's "KMS master key" as Parquet sees it: `_DatasetKms.wrap_key`
encrypts Parquet's key-encryption keys with it (AES-256-GCM, the key id as associated data).
Rotating the keyring's master key re-wraps the dataset key in the manifest, and no shard is
rewritten. `DatasetKeys` holds only wrapped keys and a key reference, so it travels to Ray
workers, which unwrap it with the keyring on their node.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import secrets
import threading
from dataclasses import dataclass, field, replace
from typing import Any

import pyarrow.parquet as pq
import pyarrow.parquet.encryption as pe
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from petatrain.errors import CorruptDataError
from petatrain.security.keys import KeyringError, open_keys

ALGORITHM = "parquet-modular/AES_GCM_V1"
_NONCE = 12


@dataclass(frozen=True, kw_only=True, slots=True)
class DatasetKeys:
    """A dataset's keys as its manifest records them (wrapped), and the keyring that unwraps them.

    `write_key` is the key id new shards are written with ("" writes plaintext)."""

    keyref: str
    id: str  # the dataset's key set; part of what every dataset key is wrapped for
    wrapped: dict[str, dict[str, Any]] = field(default_factory=dict)  # key id -> {"key", "key_version"}
    write_key: str = ""
    # A key service's credentials (Protection.kms_credentials), so that the processes these
    # keys are sent to reach it too; never shown.
    kms_credentials: Any = field(default=None, repr=False, compare=False)

    def context(self, key_id: str) -> str:
        return f"dataset {self.id}/key {key_id}"

    @property
    def record(self) -> dict[str, Any]:
        """What the manifest stores: nothing secret."""
        return {"algorithm": ALGORITHM, "id": self.id, "keys": self.wrapped}

    def encryption_properties(self) -> pe.FileEncryptionProperties | None:
        """For a new file under `write_key`: footer and every column encrypted; None for plaintext."""
        if not self.write_key:
            return None
        config = pe.EncryptionConfiguration(
            footer_key=self.write_key,
            uniform_encryption=True,
            encryption_algorithm="AES_GCM_V1",
            data_key_length_bits=256,
            double_wrapping=True,
            cache_lifetime=datetime.timedelta(minutes=10),
        )
        return _factory(self).file_encryption_properties(pe.KmsConnectionConfig(), config)

    def decryption_properties(self) -> pe.FileDecryptionProperties:
        return _factory(self).file_decryption_properties(
            pe.KmsConnectionConfig(), pe.DecryptionConfiguration(cache_lifetime=datetime.timedelta(minutes=10))
        )

    def check(self) -> None:
        """Unwrap every key now: a wrong keyring is one line before any shard is read or written."""
        for key_id in self.wrapped:
            _unwrap(self, key_id)

    def rewrapped(self) -> DatasetKeys:
        """These keys wrapped by the keyring's primary master key version (the shards unchanged)."""
        keys = open_keys(self.keyref, self.kms_credentials)
        wrapped = {
            key_id: {"key": keys.wrap(_unwrap(self, key_id), self.context(key_id)), "key_version": keys.primary}
            for key_id in self.wrapped
        }
        return replace(self, wrapped=wrapped)


def new_keys(keyref: str, credentials: Any = None) -> DatasetKeys:
    """A first dataset key (id "k1"), wrapped by the keyring's primary version (`credentials`: a key
    service's, `Protection.kms_credentials`)."""
    keys = open_keys(keyref, credentials)
    made = DatasetKeys(keyref=keyref, id=secrets.token_hex(8), write_key="k1", kms_credentials=credentials)
    key = AESGCM.generate_key(bit_length=256)
    made.wrapped["k1"] = {"key": keys.wrap(key, made.context("k1")), "key_version": keys.primary}
    return made


def from_record(keyref: str, record: Any, where: str, credentials: Any = None) -> DatasetKeys:
    """The keys a manifest records (`DatasetKeys.record`), to be unwrapped with `keyref`."""
    if (
        not isinstance(record, dict)
        or record.get("algorithm") != ALGORITHM
        or not isinstance(record.get("id"), str)
        or not isinstance(record.get("keys"), dict)
        or not all(isinstance(v, dict) and isinstance(v.get("key"), str) for v in record["keys"].values())
    ):
        raise CorruptDataError(f"{where}: its encryption record is not one this petatrain reads ({ALGORITHM})")
    ids = sorted(record["keys"])
    return DatasetKeys(
        keyref=keyref,
        id=record["id"],
        wrapped=dict(record["keys"]),
        write_key=ids[-1] if ids else "",
        kms_credentials=credentials,
    )


_unwrapped: dict[tuple[str, str, str, str], bytes] = {}
_lock = threading.Lock()


def _unwrap(keys: DatasetKeys, key_id: str) -> bytes:
    record = keys.wrapped.get(key_id)
    if record is None:
        raise KeyringError(f"dataset key {key_id!r} is not in the manifest's encryption record")
    cache = (keys.keyref, keys.id, key_id, record["key"])
    with _lock:
        found = _unwrapped.get(cache)
    if found is None:
        found = open_keys(keys.keyref, keys.kms_credentials).unwrap(record["key"], keys.context(key_id))
        with _lock:
            _unwrapped[cache] = found
    return found


class _DatasetKms(pe.KmsClient):
    """Parquet's KMS client: wraps Parquet's key-encryption keys with the dataset key they name."""

    def __init__(self, keys: DatasetKeys):
        super().__init__()
        self._keys = keys

    def wrap_key(self, key_bytes: bytes, master_key_identifier: str) -> str:
        nonce = secrets.token_bytes(_NONCE)
        aead = AESGCM(_unwrap(self._keys, master_key_identifier))
        return base64.b64encode(nonce + aead.encrypt(nonce, key_bytes, master_key_identifier.encode())).decode()

    def unwrap_key(self, wrapped_key: str, master_key_identifier: str) -> bytes:
        try:
            blob = base64.b64decode(wrapped_key.encode(), validate=True)
            aead = AESGCM(_unwrap(self._keys, master_key_identifier))
            return aead.decrypt(blob[:_NONCE], blob[_NONCE:], master_key_identifier.encode())
        except (InvalidTag, binascii.Error, ValueError):
            raise CorruptDataError(
                f"its key does not unwrap with dataset key {master_key_identifier!r} (not this dataset's shard, "
                "or its footer was changed)"
            ) from None


_factories: dict[tuple, pe.CryptoFactory] = {}


def _factory(keys: DatasetKeys) -> pe.CryptoFactory:
    """One CryptoFactory per key set: pyarrow caches unwrapped key-encryption keys in it."""
    identity = (keys.keyref, keys.id, tuple(sorted((k, v["key"]) for k, v in keys.wrapped.items())))
    with _lock:
        factory = _factories.get(identity)
        if factory is None:
            factory = _factories[identity] = pe.CryptoFactory(lambda _config: _DatasetKms(keys))
    return factory


def open_parquet(source: Any, keys: DatasetKeys | None) -> pq.ParquetFile:
    """A Parquet file, decrypted with `keys` if it is encrypted (a plaintext file reads as it is)."""
    return pq.ParquetFile(source, decryption_properties=keys.decryption_properties() if keys else None)
