"""The run directory: train writes only into a run of its own, or into a new or empty folder,
and one driver at a time.

A run carries `RUN/.petatrain-run` (JSON: format "petatrain-run", version, created), written
when train first claims the folder; a run made before the marker has an `events.jsonl` with
a `run_start` event. Any other non-empty folder is someone else's: train refuses it rather
than overwrite its config.yaml, final/ or report.html, or let retention prune its checkpoints/.
For the run's duration the driver holds a lease on `RUN/_lock` (`petatrain.storage.lock`):
a second driver on the same run fails at once instead of interleaving its checkpoints.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from petatrain.observe.ledger import EVENTS_FILE, PriorRun, prior_run_from, typed_events
from petatrain.storage import StorageOptions, folder, join
from petatrain.storage.fs import exists, refuse_linked_entries, resolve
from petatrain.storage.lock import LEASE_FILE, Lease

MARKER = ".petatrain-run"
WRITTEN_FOLDERS = ("checkpoints", "final", "prometheus")  # what train writes below the run folder itself
FORMAT = "petatrain-run"
VERSION = 1


@contextlib.contextmanager
def held(run_url: str, options: StorageOptions | None = None, *, wait_s: float = 0.0) -> Iterator[Lease]:
    """Refuse someone else's folder, then hold the run's lease (marking the folder a run) until
    the block ends; `LeaseHeld` (one line: host, pid, since when) while another driver holds it,
    after waiting up to `wait_s` for it (a driver that died stops renewing its lease)."""
    made = not exists(run_url, options)
    fresh = not _check(run_url, options)
    refuse_linked_entries(run_url, descend=WRITTEN_FOLDERS)
    lease = Lease(join(run_url, LEASE_FILE), kind="train", what=f"--run-dir {run_url}", options=options)
    lease.acquire(wait_s)
    refused = False
    try:
        folder.mark(run_url, MARKER, kind=FORMAT, options=options)
        yield lease
    except BaseException:
        refused = fresh
        raise
    finally:
        lease.release()
        if refused:  # a new folder whose run was refused before it wrote anything: as it was before
            folder.unmark_if_bare(run_url, MARKER, options, remove_folder=made)


def claim(run_url: str, options: StorageOptions | None = None) -> None:
    """Make `run_url` a petatrain run (new, empty, or one already): write its marker; a file or
    a non-empty folder that is not a run is refused with a one-line PetatrainError."""
    if not _check(run_url, options):
        folder.mark(run_url, MARKER, kind=FORMAT, options=options)


def _check(run_url: str, options: StorageOptions | None) -> bool:
    return folder.check(
        run_url,
        MARKER,
        kind=FORMAT,
        noun="petatrain run",
        what=f"--run-dir {run_url}",
        options=options,
        ours_before_marker=lambda: _has_run_start(run_url, options),
    )


def _has_run_start(run_url: str, options: StorageOptions | None) -> bool:
    """A run made before the marker: its ledger has a `run_start` event (the first one it wrote)."""
    fs, path = resolve(join(run_url, EVENTS_FILE), options)
    try:
        with fs.open(path, "rb") as handle:
            for line in handle:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a torn line
                if isinstance(event, dict) and event.get("event") == "run_start":
                    return True
    except (FileNotFoundError, IsADirectoryError):
        return False
    return False


def run_id(run_url: str, options: StorageOptions | None = None) -> str:
    """The run's id from its marker (written once, when train first claims the folder); "" for a
    run marked before markers carried one. Encrypted checkpoints are bound to it. Read each time
    (one small read per checkpoint file): a folder removed and claimed again has a new id."""
    return folder.identity(run_url, MARKER, options)


def prior_run(run_url: str, options: StorageOptions | None = None) -> PriorRun | None:
    """The run this folder's ledger holds, or None for a new folder (or a run that never started)."""
    try:
        events = typed_events(run_url, options)
    except FileNotFoundError:
        return None
    return prior_run_from(events)
