"""The loader's promise shown on a dataset: stream an epoch with 2 ranks, stop half-way,
resume with 3 ranks from rank 0's saved state, and check every sample came exactly once."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from petatrain.data.loading.stream import loader


def elastic_resume(url: str, *, batch_size: int = 16, seed: int = 0, before: int = 2, after: int = 3) -> dict[str, Any]:
    """Run the scenario with simulated ranks in this process; returns what happened."""

    def ranks(world: int, state: dict | None):
        out = [
            loader(url, batch_size=batch_size, num_workers=0, rank=r, world_size=world, seed=seed) for r in range(world)
        ]
        for dl in out:
            if state is not None:
                dl.load_state_dict(state)
        return out

    first = ranks(before, None)
    total = first[0].dataset.num_samples
    steps = max(1, total // 2 // (before * batch_size))
    seen: list[int] = []
    iters = [iter(dl) for dl in first]
    for _ in range(steps):  # lockstep: every rank takes one batch per step
        for it in iters:
            seen.extend(next(it)["index"].tolist())
    state = json.loads(json.dumps(first[0].state_dict()))  # what a checkpoint would store
    consumed_before = len(seen)
    for dl in ranks(after, state):
        for batch in dl:
            seen.extend(batch["index"].tolist())
    counts = Counter(seen)
    return {
        "dataset": url,
        "samples_in_epoch": total,
        "ranks_before": before,
        "consumed_before": consumed_before,
        "ranks_after": after,
        "consumed_after": len(seen) - consumed_before,
        "state": state,
        "duplicates": sum(1 for c in counts.values() if c > 1),
        "missing": total - len(counts),
        "exactly_once": len(seen) == total == len(counts),
    }
