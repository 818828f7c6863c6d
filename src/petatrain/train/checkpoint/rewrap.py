"""Re-wrapping a run's data keys with the keyring's primary master key (`petatrain keys rotate`).

A checkpoint's wrapped data keys sit in its COMMITTED record, the final weights' in theirs; each
record is rewritten in one atomic write (re-signed when the keyring signs), and no sealed file is
touched. Run holding the run's lease: a driver training on the run refuses to start meanwhile.
"""

from __future__ import annotations

import json
from typing import Any

from petatrain.errors import CorruptDataError
from petatrain.security import signing
from petatrain.security.keys import encryption_keys
from petatrain.security.sealed import rewrap
from petatrain.storage import StorageOptions, join
from petatrain.storage.fs import atomic_write, exists, read_bytes
from petatrain.train.checkpoint.final import RECORD, final_context, final_dir
from petatrain.train.checkpoint.reader import committed_steps, file_context, read_state
from petatrain.train.checkpoint.state import COMMITTED, STATE, step_dir
from petatrain.train.checkpoint.writer import commit_record


def rewrap_run(run_url: str, options: StorageOptions) -> dict[str, Any]:
    """Re-wrap every committed checkpoint's and the final weights' data keys; what was rewritten."""
    keys = encryption_keys(options)
    if keys is None:
        raise CorruptDataError("re-wrapping a run needs storage.encryption.key")
    checkpoints = 0
    for step in committed_steps(run_url, options):
        state = read_state(run_url, step, options)  # verified (and its signature checked) before it is changed
        if not state.keys:
            continue
        folder = step_dir(run_url, step)
        fresh = {
            name: rewrap(keys, record, file_context(run_url, step, name, options))
            for name, record in state.keys.items()
        }
        raw = read_bytes(join(folder, STATE), options)
        marker = json.loads(read_bytes(join(folder, COMMITTED), options))
        # Signed again only if it was: a signature needs the files' SHA-256s, which only a signing writer records.
        again = commit_record(
            raw, marker["state_checksum"], fresh, options, sign="signature" in marker, run=str(marker.get("run") or "")
        )
        atomic_write(join(folder, COMMITTED), again, options)
        checkpoints += 1
    final = False
    marker_url = join(final_dir(run_url), RECORD)
    if exists(marker_url, options):
        record = json.loads(read_bytes(marker_url, options))
        what = f"{marker_url}"
        signing.check(options, signing.canonical(record), record.get("signature"), what)
        if isinstance(record, dict) and "encryption" in record:
            record["encryption"] = rewrap(keys, record["encryption"], final_context(run_url, options))
            if record.pop("signature", None) is not None and signing.signs(options):
                record["signature"] = signing.sign(options, signing.canonical(record))
            atomic_write(marker_url, json.dumps(record).encode(), options)
            final = True
    return {"run": run_url, "checkpoints": checkpoints, "final": final, "key_version": keys.primary}
