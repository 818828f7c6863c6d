"""Ray Train's errors -> petatrain's typed `AttemptFailed` (runtime.failures)."""

from __future__ import annotations

from petatrain.runtime.failures import AttemptFailed, Causes, RankErrorKind, rank_error


def attempt_failed(error: BaseException, causes: Causes | None = None) -> AttemptFailed:
    """What `TorchTrainer.fit()` raised, as one typed error per failing rank.

    Ray Train's `WorkerGroupError.worker_failures` maps each failing rank to the exception its
    training function raised (unwrapped), or to the health check's error when the rank's
    process died or stopped answering. Anything else (the controller's error, a worker group
    that never started) is one error without a rank.
    """
    from ray.exceptions import ActorDiedError
    from ray.train import WorkerGroupError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError

    if isinstance(error, AttemptFailed):
        return error
    if not isinstance(error, WorkerGroupError):
        kind = RankErrorKind.DIED if isinstance(error, ActorDiedError) else RankErrorKind.OTHER
        return AttemptFailed([rank_error(None, error, kind, causes)], str(error))
    errors = []
    for rank, exc in sorted(error.worker_failures.items()):
        if isinstance(exc, (WorkerHealthCheckFailedError, ActorDiedError)):
            kind = RankErrorKind.DIED
        elif isinstance(exc, WorkerHealthCheckTimeoutError):
            kind = RankErrorKind.UNRESPONSIVE
        else:
            kind = RankErrorKind.RAISED
        errors.append(rank_error(rank, exc, kind, causes))
    return AttemptFailed(errors, str(error))
