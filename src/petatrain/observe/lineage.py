"""A run's lineage: what it trained on, and the chain of runs it started from, back to the first.

Everything comes from the runs' own ledgers (nothing else is kept): a run's `run_start` names the
dataset version it reads (`data.dataset: DATASET@vN`) and, for a run started from another run's
checkpoint, where it came from (`source: {from: RUN@STEP, step, carry}`; `carry` is what a
`train --continue` carry-over pass holds: the versions, the new training rows it reads once and the
rows of the earlier version it replays). How much of each version a run read follows from its steps
and `train.global_batch`: the pass deals its replays evenly (`data/loading/continuation.py`), so
after n samples of a pass of L holding R replays, floor(n·R/L) were replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from petatrain.observe.events import Eval, Event, RunStart
from petatrain.storage import StorageOptions
from petatrain.storage.fs import exists, is_local, join

MAX_LINKS = 1000  # a chain longer than this is cut (and a cycle, which a ledger cannot make, stops it)


@dataclass(frozen=True, slots=True)
class Read:
    """Rows of one dataset version a run read: "new" (added since the version it continued from,
    each once), "replay" (of that earlier version), or "epochs" (the version whole, in order)."""

    dataset: str
    version: int | None
    kind: str
    rows: int


@dataclass(frozen=True, slots=True)
class Link:
    """One run of a lineage."""

    run: str
    run_id: str
    status: str  # ok | failed | stopped | interrupted
    how: str  # "start" | "continue" (onto new data) | "from" (a branch) | "exploit" (a search's PBT)
    source: str | None  # RUN@STEP it started from
    start_step: int
    step: int
    samples: int
    tokens: int
    eval_loss: float | None
    reads: list[Read] = field(default_factory=list)
    replay: float | None = None  # data.replay of a continuation

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def link(run_url: str, events: Sequence[Event]) -> Link:
    """The lineage record of one run, from its ledger's events."""
    from petatrain.data.index import split_version
    from petatrain.observe.ledger import prior_run_from

    start = next(e for e in events if isinstance(e, RunStart))
    prior = prior_run_from(events)
    config = prior.config if prior is not None else start.config
    data, train, model = (config.get(k) or {} for k in ("data", "train", "model"))
    dataset, version = split_version(str(data.get("dataset") or ""))
    source = start.source
    carry = source.get("carry") if source else None
    label = str(source.get("from")) if source else None
    how = "start" if label is None else "continue" if carry else "exploit" if label.startswith("trial ") else "from"
    start_step = int(source.get("step") or 0) if source else 0
    step = prior.step if prior is not None else start_step
    samples = max(0, step - start_step) * int(train.get("global_batch") or 0)
    evals = [e for e in events if isinstance(e, Eval)]
    status = (prior.ended or "interrupted") if prior is not None else "interrupted"
    return Link(
        run=run_url,
        run_id=start.run_id,
        status=status,
        how=how,
        source=label,
        start_step=start_step,
        step=step,
        samples=samples,
        tokens=samples * int(model.get("seq_len") or 0),
        eval_loss=evals[-1].loss if evals else None,
        reads=_reads(dataset, version, samples, carry if isinstance(carry, dict) else None),
        replay=float(data.get("replay", 0.0)) if carry else None,
    )


def _reads(dataset: str, version: int | None, samples: int, carry: dict[str, Any] | None) -> list[Read]:
    if carry is None:
        return [Read(dataset, version, "epochs", samples)] if samples else []
    new, replays = int(carry.get("new_rows") or 0), int(carry.get("replay_rows") or 0)
    total = new + replays
    in_pass = min(samples, total)
    replayed = in_pass * replays // total if total else 0
    reads = [
        Read(dataset, int(carry.get("to_version") or 0) or version, "new", in_pass - replayed),
        Read(dataset, int(carry.get("from_version") or 0) or None, "replay", replayed),
    ]
    if samples > total:
        reads.append(Read(dataset, version, "epochs", samples - total))
    return [r for r in reads if r.rows]


def chain(run_url: str, options: StorageOptions | None = None) -> list[dict[str, Any]]:
    """The run and every run it started from, newest first; a source that is gone ends the chain
    with {"run": ..., "missing": true}."""
    from petatrain.observe.ledger import load_events, typed_events

    links: list[dict[str, Any]] = []
    url: str | None = run_url
    seen: set[str] = set()
    events = load_events(run_url, options)  # the run itself must be there: one line if not
    while url is not None and url not in seen and len(links) < MAX_LINKS:
        seen.add(url)
        if links:
            if not exists(join(url, "events.jsonl"), options):
                links.append({"run": url, "missing": True})
                break
            events = typed_events(url, options)
        if not any(isinstance(e, RunStart) for e in events):
            links.append({"run": url, "missing": True})
            break
        record = link(url, events)
        links.append(record.to_dict())
        url = _source_run(record.source) if record.how in ("continue", "from") else None
    return links


def _source_run(label: str | None) -> str | None:
    """RUN of a source label RUN@STEP."""
    if not label:
        return None
    run, at, step = label.rpartition("@")
    if not at or not step.isdigit():
        return None
    return run if not is_local(run) else run.rstrip("/")


def trained_on(events: Sequence[Event], run_url: str) -> list[dict[str, Any]]:
    """What a run read, for its report: [{dataset, version, kind, rows}]."""
    if not any(isinstance(e, RunStart) for e in events):
        return []
    return [asdict(r) for r in link(run_url, events).reads]
