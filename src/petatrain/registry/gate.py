"""The evaluation gate: a candidate model against the one it would replace, on the same held-out rows.

Both are evaluated on the held-out rows of one dataset version (`data.eval_split: rows`: the same
rows in every version, so a row a model trained on is never in them), in three splits:

- `all`: every held-out row of the version;
- `newest`: those of the shards its latest commit added (the new data);
- `earlier`: those of the shards before it (what a continued model must not forget).

Each is the mean next-token loss over at most `max_rows` rows, in the dataset's order, the same
rows for both models. The verdict follows the policy in the config's `promote` section: the
candidate passes when its loss on `newest` is lower than the incumbent's by at least
`promote.min_improvement` (relative), and its loss on `earlier` is higher by at most
`promote.max_regression` (relative). With no incumbent it passes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from petatrain.config import JobConfig
from petatrain.errors import ConfigError
from petatrain.storage import StorageOptions

SPLITS = ("all", "newest", "earlier")


@dataclass(frozen=True, slots=True)
class Loaded:
    """A model ready to evaluate, and what it is."""

    ref: str
    config: JobConfig
    module: torch.nn.Module
    loss_fn: Any
    describe: dict[str, Any]


def load_model(run: str, checkpoint: str, options: StorageOptions | None, label: str) -> Loaded:
    from petatrain.models import build_model
    from petatrain.train.weights import load

    served = load(run, checkpoint, options)
    spec = build_model(served.config.model, served.config.train)
    spec.module.load_state_dict(served.weights)
    spec.module.eval()
    return Loaded(label, served.config, spec.module, spec.loss_fn, served.describe())


def held_out_losses(
    model: Loaded, dataset: str, fraction: float, options: StorageOptions | None, max_rows: int, micro: int = 16
) -> dict[str, dict[str, Any]]:
    """{split: {"loss", "rows"}} of `model` on the held-out rows of `dataset` (a version)."""
    from petatrain.data import index as idx
    from petatrain.data.loading.stream import StreamingDataset

    manifest = idx.read_manifest(dataset, options)
    if manifest is None:
        raise ConfigError(f"no dataset at {dataset}")
    shards = manifest.totals.shards
    root, _ = idx.split_version(dataset)
    earlier = [v for v in idx.version_numbers(root, options) if v < manifest.generation]
    before = idx.read_manifest(idx.versioned(root, earlier[-1]), options) if earlier else None
    cut = before.totals.shards if before is not None else 0
    ranges = {"all": (0, shards), "newest": (cut, shards), "earlier": (0, cut)}
    seq = model.config.model.seq_len + 1
    out: dict[str, dict[str, Any]] = {}
    for split, (lo, hi) in ranges.items():
        if lo >= hi:
            out[split] = {"loss": None, "rows": 0, "shards": [lo, hi]}
            continue
        data = StreamingDataset(
            dataset, shuffle=False, batch_size=micro, columns=["tokens"], options=options, shards=(lo, hi),
            held_out=fraction, split="eval", prefetch=False,
        )  # fmt: skip
        total, rows = 0.0, 0
        with torch.no_grad():
            for batch in data.iter_batches():
                tokens = torch.as_tensor(batch["tokens"])[:, :seq].to(torch.long)
                tokens = tokens[: max_rows - rows]
                total += float(model.loss_fn(model.module, tokens)) * len(tokens)
                rows += len(tokens)
                if rows >= max_rows:
                    break
        out[split] = {"loss": total / rows if rows else None, "rows": rows, "shards": [lo, hi]}
    return out


def verdict(
    candidate: dict[str, dict[str, Any]], incumbent: dict[str, dict[str, Any]] | None, promote: Any
) -> dict[str, Any]:
    """Whether the candidate passes the gate, and why (one line)."""
    if incumbent is None:
        return {"passed": True, "reason": "no model to compare with: the first version passes"}
    reasons, passed = [], True
    newest, label = "newest", "newest data"
    few = candidate["newest"]["loss"] is not None and candidate["newest"].get("rows", 0) < promote.min_rows
    if few:  # a handful of rows decides nothing: the improvement is judged on every held-out row
        newest = "all"
        label = (
            f"newest data has {candidate['newest']['rows']} held-out rows (fewer than promote.min_rows "
            f"{promote.min_rows}), so all held-out rows"
        )
    new_c, new_i = candidate[newest]["loss"], incumbent[newest]["loss"]
    if new_c is not None and new_i is not None:
        gain = (new_i - new_c) / new_i if new_i else 0.0
        ok = gain >= promote.min_improvement
        passed &= ok
        reasons.append(
            f"{label}: {new_c:.4f} vs {new_i:.4f} ({_relative(gain)}, needs {100 * promote.min_improvement:.2f}% "
            "better or more)"
        )
    old_c, old_i = candidate["earlier"]["loss"], incumbent["earlier"]["loss"]
    if old_c is not None and old_i is not None:
        regression = (old_c - old_i) / old_i if old_i else 0.0
        ok = regression <= promote.max_regression
        passed &= ok
        reasons.append(
            f"earlier data: {old_c:.4f} vs {old_i:.4f} ({_relative(-regression)}, may be up to "
            f"{100 * promote.max_regression:.2f}% worse)"
        )
    if not reasons:
        all_c, all_i = candidate["all"]["loss"], incumbent["all"]["loss"]
        ok = all_c is not None and all_i is not None and all_c <= all_i * (1 - promote.min_improvement)
        passed &= ok
        reasons.append(f"held-out rows: {all_c} vs {all_i}")
    if any(isinstance(v, float) and not math.isfinite(v) for v in (new_c, old_c)):
        passed, reasons = False, [*reasons, "the candidate's loss is not finite"]
    return {"passed": bool(passed), "reason": "; ".join(reasons)}


def _relative(gain: float) -> str:
    """+0.043 -> "4.30% better", -0.01 -> "1.00% worse"."""
    return f"{100 * abs(gain):.2f}% {'better' if gain >= 0 else 'worse'}"
