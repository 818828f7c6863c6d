"""A search's storage credentials, kept out of everything Ray Tune writes.

Tune pickles its run config, the callbacks and the filesystem it keeps its state with included,
into `OUT/tune/tuner.pkl` (uploaded with the rest when OUT is on an object store), and it hands
the driver's AWS_* variables to its trial actors as a runtime environment, which Ray's runtime
environment agent writes into its log. So nothing a search gives Tune holds a credential:

- the filesystem Tune writes its state with (`SearchStore`) pickles as the search's folder, its
  storage options without secrets, and a reference to the whole options in Ray's object store
  (memory, owned by the driver: a trial actor resolves it there, a `tuner.pkl` read after the
  driver is gone holds a dead reference and is given a new filesystem on restore);
- the driver's callbacks take the options from this process (`hold`, `held`);
- while Tune runs, the AWS_* credential variables are out of the driver's environment
  (`credentials_out_of_environment`): the options the trials get already carry them.

The trials themselves get the options through `tune.with_parameters`, which also lives in Ray's
object store, in memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import pyarrow.fs as pafs

from petatrain.storage import StorageOptions
from petatrain.storage.fs import resolve

log = logging.getLogger(__name__)

# What Ray Tune copies from the driver's environment into its trial actors' runtime environment
# (ray.tune.execution.class_cache.ENV_VARS_TO_PROPAGATE), and so into Ray's logs.
AWS_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN")

_held: dict[str, StorageOptions] = {}  # search folder -> its options, in the process that holds them


def hold(out: str, options: StorageOptions) -> None:
    """The options of the search in `out`, for this process's callbacks and stores."""
    _held[out] = options


def held(out: str) -> StorageOptions | None:
    return _held.get(out)


@contextlib.contextmanager
def credentials_out_of_environment() -> Iterator[None]:
    """Take the AWS_* credential variables out of this process's environment for the block, and
    put them back after (the search's options carry them already, filled in by `for_workers`)."""
    saved = {name: os.environ.pop(name) for name in AWS_CREDENTIALS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class SearchStore(pafs.FSSpecHandler):
    """The pyarrow filesystem handler Tune keeps its state with: petatrain's own filesystem for the
    search's folder (same endpoint, credentials, SSE), resolved on first use, pickled without secrets."""

    def __init__(self, out: str, options: StorageOptions, secrets: Any = None):
        # No FSSpecHandler.__init__: `fs` is resolved when first used (after unpickling, in the process).
        self.out = out
        self.public = options.without_secrets()
        self.secrets = secrets  # a Ray object reference to the whole options, or None
        self._fs: Any = None

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = resolve(self.out, self._options())[0]
        return self._fs

    def _options(self) -> StorageOptions:
        options = held(self.out)
        if options is not None:
            return options
        if self.secrets is not None:
            import ray

            try:
                return ray.get(self.secrets, timeout=60)
            except Exception as exc:  # the driver that put them is gone: this process's own environment
                log.debug("the search's storage options are not in Ray's object store: %s", exc)
        return self.public.for_workers()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle, (self.out, self.public, self.secrets))


def _unpickle(out: str, public: StorageOptions, secrets: Any) -> SearchStore:
    store = SearchStore(out, public)
    store.secrets = secrets
    return store


def tune_storage(out: str, options: StorageOptions) -> tuple[str, Any]:
    """Where Tune keeps its state (OUT itself) and, for an object store, the filesystem it uses."""
    from petatrain.storage.fs import is_local

    if is_local(out):
        return out, None
    import ray

    path = resolve(out, options.without_secrets())[1]
    return path, pafs.PyFileSystem(SearchStore(out, options, ray.put(options)))
