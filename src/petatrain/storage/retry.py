"""Bounded retries with exponential backoff and jitter for transient storage errors, and the
one-line errors for those a retry cannot fix (access denied, a certificate, an SSE-C key)."""

from __future__ import annotations

import errno
import logging
import random
import re
import ssl
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from petatrain.errors import AccessDeniedError, StorageAccessError

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_ATTEMPTS = 5
BASE_DELAY_S = 0.2
MAX_DELAY_S = 5.0

_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.EAGAIN}
_TRANSIENT_CODES = {
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "InternalError",
    "ServiceUnavailable",
    "503",
    "500",
    "502",
    "504",
}


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry can fix: resets, timeouts, 5xx and throttling."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if is_tls_verification_failure(exc):
        return False
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code == "NotImplemented" or status == 501:  # a 5xx that no retry changes
            return False
        if code in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500):
            return True
    name = type(exc).__name__
    if name in {
        "EndpointConnectionError",
        "ConnectionClosedError",
        "ReadTimeoutError",
        "ClientOSError",
        "ServerDisconnectedError",
        "ResponseStreamingError",
    }:
        return True
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_transient(cause)


def retrying(
    what: str, fn: Callable[[], T], *, attempts: int = MAX_ATTEMPTS, sleep: Callable[[float], None] = time.sleep
) -> T:
    """Call `fn`, retrying transient errors up to `attempts` times; each retry is logged.

    `what` is the operation and its URL ("write s3://b/k"): errors a retry cannot fix and a
    user can (access denied, a certificate that does not verify, an SSE-C key) are raised as
    one line naming it.
    """
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not is_transient(exc):
                explained = explain_remote_error(exc, what)
                if explained is not None:
                    raise explained from exc
                raise
            delay = min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs", what, type(exc).__name__, exc, attempt, attempts - 1, delay
            )
            sleep(delay)
    raise AssertionError("unreachable")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen and len(seen) < 16:
        seen.add(id(node))
        yield node
        node = node.__cause__ or node.__context__


def is_tls_verification_failure(exc: BaseException) -> bool:
    """The server's TLS certificate did not verify (unknown CA, wrong host name, expired), or
    the endpoint does not speak TLS at all: never fixed by a retry."""
    for node in _chain(exc):
        if isinstance(node, ssl.SSLCertVerificationError) or type(node).__name__ == "ClientConnectorCertificateError":
            return True
        if isinstance(node, ssl.SSLError) and "WRONG_VERSION_NUMBER" in str(node):
            return True
    return False


_ENDPOINT = re.compile(r"(https?://[^/\s\]\[\"']+)")
_VERIFY_REASON = re.compile(r"certificate verify failed: ([^()'\"\]]+)")
_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
}
_SSE_C_HINTS = ("customer provided key", "md5 hash of the key", "customer-provided", "sse-c", "encryption key")


def _error_code(exc: BaseException) -> tuple[str, str]:
    """(S3 error code, operation) of the botocore error along `exc`'s chain, or ("", "")."""
    for node in _chain(exc):
        response = getattr(node, "response", None)
        if isinstance(response, dict) and "Error" in response:
            return str(response["Error"].get("Code", "")), str(getattr(node, "operation_name", ""))
    return "", ""


def explain_remote_error(exc: BaseException, what: str) -> StorageAccessError | None:
    """The one-line error for `exc` raised by `what` ("read s3://b/k") on an object store, when
    it is one a user fixes: access denied or credentials refused, a certificate that does not
    verify, an object encrypted with a customer key (SSE-C) read without it; else None.

    Messages never carry request parameters (an SSE-C key is one), only codes and URLs.
    """
    if "://" not in what or isinstance(exc, StorageAccessError):
        return None
    if is_tls_verification_failure(exc):
        found = next((m.group(1) for node in _chain(exc) if (m := _ENDPOINT.search(str(node)))), "the S3 endpoint")
        text = " ".join(str(node) for node in _chain(exc))
        why = _VERIFY_REASON.search(text)
        reason = why.group(1).strip() if why else ("WRONG_VERSION_NUMBER" if "WRONG_VERSION_NUMBER" in text else "")
        if reason == "WRONG_VERSION_NUMBER":
            return StorageAccessError(f"{what}: {found} does not speak TLS (is it a plain-HTTP endpoint?)")
        return StorageAccessError(
            f"{what}: the TLS certificate of {found} does not verify ({reason or 'certificate verify failed'}); "
            "storage.ca_bundle must name the PEM file of the CA that issued it"
        )
    code, operation = _error_code(exc)
    if code in _CREDENTIAL_CODES:
        return AccessDeniedError(
            f"{what}: the object store does not accept these credentials ({code}): a wrong or expired identity"
        )
    if isinstance(exc, PermissionError) or code in ("AccessDenied", "403"):
        shown = {"": "AccessDenied", "AccessDenied": "AccessDenied", "403": "AccessDenied (403 Forbidden)"}
        return AccessDeniedError(
            f"{what}: {shown.get(code, f'AccessDenied ({code})')}: the identity in use may not do this "
            "(its policy does not allow it, or its credentials are wrong or expired)"
        )
    text = " ".join(str(node) for node in _chain(exc)).lower()
    if (code == "400" and operation == "HeadObject") or (
        code in ("InvalidArgument", "InvalidRequest", "400") and any(hint in text for hint in _SSE_C_HINTS)
    ):
        return StorageAccessError(
            f"{what}: the store refused the read ({code}: Bad Request), as it does for an object encrypted with a "
            "customer-provided key (SSE-C) read without that key or with another: set storage.sse.mode: customer "
            "and storage.sse.customer_key to the key it was written with"
        )
    return None
