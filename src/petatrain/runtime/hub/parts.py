"""The checkpoint-part rendezvous: every rank reports the files it wrote; rank 0 waits for all to commit."""

from __future__ import annotations

from petatrain.runtime.hub.attempt import Attempt, Drain


class PartsRendezvous:
    """Each rank's written files of a checkpoint, by (attempt, step), until rank 0 takes them."""

    def __init__(self, attempt: Attempt, drain: Drain):
        self._attempt, self._drain = attempt, drain
        self.parts: dict[tuple[int, int], dict[int, dict | None]] = {}  # (attempt, step) -> rank -> files
        attempt.on_new(self._forget_older)

    def _forget_older(self, attempt: int) -> None:
        # A waiter of a failed attempt must not take the parts of the new one.
        self.parts = {k: v for k, v in self.parts.items() if k[0] >= attempt}

    def report(self, attempt: int, step: int, rank: int, files: dict | None) -> None:
        """A rank's written files for a checkpoint, or None when its write failed."""
        with self._attempt.cond:
            self.parts.setdefault((attempt, step), {})[rank] = files
            self._attempt.cond.notify_all()

    def wait(self, attempt: int, step: int, world_size: int, timeout_s: float) -> dict | None:
        """Every rank's files of a checkpoint, or None on timeout or when the attempt is over."""
        current = self._attempt
        deadline = current.clock() + timeout_s
        key = (attempt, step)
        with current.cond:
            while len(self.parts.get(key, {})) < world_size:
                got = self.parts.get(key, {})
                if any(files is None for files in got.values()):
                    self.parts.pop(key)
                    return None  # a rank's write failed
                if attempt == current.number and self._drain.lost - got.keys():
                    return None  # a rank that has not written its part is gone
                left = deadline - current.clock()
                if left <= 0 or attempt != current.number:
                    return None
                current.cond.wait(left)
            got = self.parts.pop(key)
        written = [files for files in got.values() if files is not None]
        if len(written) < len(got):
            return None  # a rank's write failed
        return {name: info for files in written for name, info in files.items()}
