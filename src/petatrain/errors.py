"""Errors a user can act on. The CLI prints them as one line, without a traceback."""


class PetatrainError(Exception):
    """A user-facing error: bad input, bad config, missing or corrupt data."""


class ConfigError(PetatrainError):
    """A config key or value is wrong; the message names the key."""


class CorruptDataError(PetatrainError):
    """A file petatrain wrote is missing or does not match its recorded checksum."""
