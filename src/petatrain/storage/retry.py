"""Bounded retries with exponential backoff and jitter for transient storage errors."""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

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
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
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
    """Call `fn`, retrying transient errors up to `attempts` times; each retry is logged."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == attempts or not is_transient(exc):
                raise
            delay = min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            log.warning(
                "%s failed (%s: %s); retry %d/%d in %.2fs", what, type(exc).__name__, exc, attempt, attempts - 1, delay
            )
            sleep(delay)
    raise AssertionError("unreachable")
