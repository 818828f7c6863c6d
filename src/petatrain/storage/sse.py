"""Server-side encryption of what petatrain writes to S3 (`storage.sse`): SSE-S3, SSE-KMS, SSE-C.

The settings become request parameters that s3fs adds to every call that takes them (its
`s3_additional_kwargs`, filtered per operation): PutObject, the multipart calls and CopyObject
get the encryption; HeadObject, GetObject (ranges too) and the copy source get an SSE-C key.
A customer key (SSE-C) is never in a config: the config names where to find it, `env:NAME` or
`file:PATH`, and the key is read when a filesystem is made. No repr, log line or error
message shows it.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass
from typing import Any, Literal

from petatrain.errors import ConfigError, PetatrainError

SSEMode = Literal["none", "s3", "kms", "customer"]
MODES: tuple[str, ...] = ("none", "s3", "kms", "customer")

# What each mode asks the store for (x-amz-server-side-encryption), and what it answers.
_ALGORITHM = {"s3": "AES256", "kms": "aws:kms"}
_SHOWN = {"s3": "SSE-S3 (AES256)", "kms": "SSE-KMS (aws:kms)", "customer": "SSE-C (a customer-provided key)"}


@dataclass(kw_only=True, slots=True, frozen=True)
class ServerSideEncryption:
    """How the object store encrypts the objects petatrain writes (config `storage.sse`).

    mode: none | s3 (keys managed by the store) | kms (a KMS key, `kms_key_id`) | customer
    (SSE-C: every request carries the 256-bit key; the store keeps only its hash).
    """

    mode: SSEMode = "none"
    kms_key_id: str = ""  # mode kms: key id, ARN or alias; "" is the store's default KMS key
    customer_key: str = ""  # mode customer: env:NAME or file:PATH holding base64 of a 256-bit key

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"storage.sse.mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.kms_key_id and self.mode != "kms":
            raise ConfigError(f"storage.sse.kms_key_id is set but storage.sse.mode is {self.mode}; use mode: kms")
        if self.mode == "customer" and not self.customer_key:
            raise ConfigError(
                "storage.sse.mode customer needs storage.sse.customer_key: env:NAME or file:PATH "
                "(where the base64 of the 256-bit key is; never the key itself)"
            )
        if self.customer_key:
            if self.mode != "customer":
                raise ConfigError(
                    f"storage.sse.customer_key is set but storage.sse.mode is {self.mode}; use mode: customer"
                )
            scheme, _, rest = self.customer_key.partition(":")
            if scheme not in ("env", "file") or not rest:
                # Never echo the value: it may be the key itself, pasted where its reference belongs.
                raise ConfigError(
                    "storage.sse.customer_key must name where the key is, env:NAME or file:PATH, "
                    "never hold the key itself (the value is not shown)"
                )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def describe(self) -> str:
        """What the mode is, for messages (never key material)."""
        return _SHOWN.get(self.mode, "none")

    def request_kwargs(self, customer_key: bytes = b"") -> dict[str, Any]:
        """The S3 request parameters of this mode; s3fs passes each to the calls that take it.

        `customer_key`: the SSE-C key already read (a Ray worker gets it from the driver);
        else it is read from `customer_key`'s reference here.
        """
        if self.mode == "none":
            return {}
        if self.mode == "customer":
            key = customer_key or read_customer_key(self.customer_key)
            return {
                "SSECustomerAlgorithm": "AES256",
                "SSECustomerKey": key,
                # a server-side copy reads an SSE-C source with its key, and writes with it
                "CopySourceSSECustomerAlgorithm": "AES256",
                "CopySourceSSECustomerKey": key,
            }
        kwargs: dict[str, Any] = {"ServerSideEncryption": _ALGORITHM[self.mode]}
        if self.kms_key_id:
            kwargs["SSEKMSKeyId"] = self.kms_key_id
        return kwargs

    def check_stored(self, head: dict[str, Any], url: str) -> None:
        """Raise unless the HeadObject answer `head` says `url` is stored as this mode asks.

        A store that does not support a mode may ignore its header and keep the object in
        the clear (Ceph RGW Pacific does so for SSE-S3): that must be an error, not a silent
        downgrade.
        """
        if self.mode == "none":
            return
        if self.mode == "customer":
            stored = head.get("SSECustomerAlgorithm") or ""
            ok = stored == "AES256"
        else:
            stored = head.get("ServerSideEncryption") or ""
            ok = stored == _ALGORITHM[self.mode]
            key = head.get("SSEKMSKeyId") or ""
            if ok and self.mode == "kms" and self.kms_key_id and key and not _same_kms_key(key, self.kms_key_id):
                raise PetatrainError(
                    f"{url} was encrypted with KMS key {key}, not storage.sse.kms_key_id {self.kms_key_id}"
                )
        if not ok:
            raise PetatrainError(
                f"{url} was stored {'as ' + stored if stored else 'unencrypted'} although storage.sse.mode is "
                f"{self.mode} ({self.describe()}): the object store ignored the request, so it does not support "
                "this mode; the object was removed; pick a mode the store supports"
            )


def _same_kms_key(stored: str, wanted: str) -> bool:
    # AWS answers with the key's ARN whatever form was asked for (id, ARN, alias)
    return stored == wanted or stored.endswith("/" + wanted) or wanted.endswith("/" + stored)


def read_customer_key(ref: str) -> bytes:
    """The 32-byte SSE-C key that `ref` (env:NAME or file:PATH) holds as base64.

    Errors name the reference and what is wrong, never the content.
    """
    scheme, _, where = ref.partition(":")
    if scheme == "env":
        value = os.environ.get(where)
        if value is None:
            raise PetatrainError(f"storage.sse.customer_key {ref}: the environment variable {where} is not set")
        text = value.encode()
    elif scheme == "file":
        path = os.path.expanduser(where)
        try:
            with open(path, "rb") as handle:
                text = handle.read(4096)
        except OSError as exc:
            raise PetatrainError(f"storage.sse.customer_key {ref}: cannot read {path} ({exc.strerror})") from None
    else:
        raise PetatrainError("storage.sse.customer_key must be env:NAME or file:PATH (the value is not shown)")
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise PetatrainError(
            f"storage.sse.customer_key {ref}: expected the base64 of a 256-bit key "
            "(as `openssl rand -base64 32` prints), which it does not hold (the content is not shown)"
        )
    return key
