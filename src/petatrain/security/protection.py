"""What protects a job's data: references to its keys (where they are, never the keys), how strictly
signatures are checked, and a key service's credentials. `StorageOptions.protection` carries it
beside the connection settings; this package's functions take either."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Protection:
    encryption_key: str = ""  # storage.encryption.key: the keys that encrypt (a KEYREF)
    signing_key: str = ""  # storage.signing.key, else the encryption keyring: the keys that sign and verify
    verify_signatures: bool = False  # storage.signing.verify: nothing unsigned is read
    unsigned_datasets: tuple[str, ...] = ()  # storage.signing.unsigned: read without a signature though a key is held
    # A key service's credentials (barbican.Credentials: OS_AUTH_TOKEN, OS_PROJECT_ID, OS_CACERT),
    # filled in by for_workers() from the driver's environment; never shown or written.
    kms_credentials: Any = field(default=None, repr=False, compare=False)

    @property
    def key_service(self) -> bool:
        """Whether a key is in a key service (Barbican), which needs credentials to reach."""
        return (self.encryption_key or self.signing_key).startswith("barbican+")

    def for_workers(self) -> Protection:
        """This protection with the key service's credentials read from this process's environment,
        where a key needs them and none are held yet: processes elsewhere do not share it."""
        if self.kms_credentials is not None or not self.key_service:
            return self
        from petatrain.security.barbican import Credentials

        return dataclasses.replace(self, kms_credentials=Credentials.from_env())

    def without_secrets(self) -> Protection:
        return dataclasses.replace(self, kms_credentials=None)


class Protected(Protocol):
    """Anything that carries a job's protection (`StorageOptions`)."""

    @property
    def protection(self) -> Protection: ...


NONE = Protection()


def protection_of(holder: Protected | Protection | None) -> Protection:
    """The protection `holder` carries (none: nothing is encrypted or signed)."""
    if holder is None:
        return NONE
    return holder if isinstance(holder, Protection) else holder.protection
