"""s3fs's filesystem with one change: a certificate that does not verify fails at once.

botocore retries every connection error, a failed certificate check too (4 retries with
backoff: ~10 s before the error surfaces), and a retry cannot fix a certificate. Imported
only when an s3:// URL is resolved (s3fs and aiobotocore take a while to import).
"""

from __future__ import annotations

from typing import Any

import s3fs

from petatrain.storage.retry import is_tls_verification_failure


class S3FileSystem(s3fs.S3FileSystem):
    async def set_session(self, refresh: bool = False, kwargs: dict[str, Any] | None = None) -> Any:
        client = await super().set_session(refresh, kwargs or {})
        client.meta.events.register_first("needs-retry.s3", _no_retry_on_tls_failure, unique_id="petatrain-tls")
        return client


def _no_retry_on_tls_failure(caught_exception: BaseException | None = None, **_: Any) -> None:
    if caught_exception is not None and is_tls_verification_failure(caught_exception):
        raise caught_exception
