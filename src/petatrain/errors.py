"""Errors a user can act on. The CLI prints them as one line, without a traceback."""


class PetatrainError(Exception):
    """A user-facing error: bad input, bad config, missing or corrupt data."""


class ConfigError(PetatrainError):
    """A config key or value is wrong; the message names the key."""


class CorruptDataError(PetatrainError):
    """A file petatrain wrote is missing or does not match its recorded checksum."""


class StorageAccessError(PetatrainError, OSError):
    """The object store refused a request for a reason the user fixes (a policy, credentials, a
    certificate, an encryption key); the message names the object and what to change."""


class AccessDeniedError(StorageAccessError, PermissionError):
    """The identity in use may not do this (AccessDenied), or its credentials are not accepted."""


class GateRefused(PetatrainError):
    """A promotion the evaluation gate refused; `evaluation` holds the figures and the verdict."""

    def __init__(self, message: str, evaluation: dict | None = None) -> None:
        super().__init__(message)
        self.evaluation = evaluation or {}
