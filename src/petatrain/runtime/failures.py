"""Why an attempt failed, as types: the errors a rank raises on purpose and the causes the supervisor records."""

from __future__ import annotations

from petatrain.errors import PetatrainError


class Preempted(PetatrainError):
    """Raised after a preemption notice once the checkpoint of the current step is committed."""
