"""`petatrain loop LOOP.yaml`: keep a model current on new data, on one machine, by itself.

Thin: the watcher (loop/watch.py) says which source files are new and stable, `api.loop_cycle` does
a cycle (append, continue, evaluate, promote); this module only schedules them, one at a time, and
shows them. Not a scheduler of its own (no parallel cycles, no cluster): Airflow or Kubernetes is."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from petatrain import api, render
from petatrain.cli.common import Address, Injects, Json, Sets, print_json, ray_session, say, verb
from petatrain.errors import AccessDeniedError, ConfigError, StorageAccessError

MAX_RETRY_WAIT_S = 300.0  # a store or registry down: the next try after poll_s, doubling, at most this


@verb()
def loop(
    loop_file: Annotated[Path, typer.Argument(help="The loop's YAML: model, job, source, dataset, runs, steps.")],
    once: Annotated[bool, typer.Option("--once", help="One cycle, then exit (as cron runs it).")] = False,
    only: Annotated[
        str,
        typer.Option(help="With --once, one part, as an orchestrator's task: ingest, train or promote."),
    ] = "",
    address: Address = "",
    set_: Sets = None,
    inject: Injects = None,
    as_json: Json = False,
) -> None:
    """Watch a source for new files; for each new set of them: append them as a new dataset version,
    continue the champion model onto it, evaluate, promote if the gate passes (a server started with
    `serve registry://MODEL@champion --follow` swaps to it). Every step is idempotent: killed anywhere,
    run it again and it goes on where it stopped, never training a version twice. `--inject` puts a
    fault into each cycle's training run, as `train --inject` does (once per run)."""
    from petatrain.chaos.inject import parse
    from petatrain.loop import spec as spec_mod
    from petatrain.loop.watch import Watcher
    from petatrain.storage.fs import join
    from petatrain.storage.lock import Lease, LeaseHeld

    if only and not once:
        raise ConfigError("--only runs one part of one cycle: give --once too")
    injections = list(inject or [])
    for injection in injections:  # a typo is one line before the first cycle, not after its ingest
        parse(injection)
    spec = spec_mod.load(loop_file, list(set_ or []))
    cfg = spec.job_config()
    options = cfg.storage.options()
    ray_session(cfg)
    watcher = Watcher(
        spec.source, spec.dataset, options, min_bytes=spec.watch.min_size, max_wait_s=spec.watch.max_wait_s
    )
    # One loop per model. An orchestrator's ingest step takes only the dataset's own lease, so that
    # it never waits on (or fails beside) a training step of the same loop.
    lease = Lease(join(spec.state, "_lock"), kind="loop", what=f"loop {spec.model}", options=options)
    try:
        if only != "ingest":
            lease.acquire()
    except LeaseHeld as held:
        from petatrain.errors import PetatrainError

        raise PetatrainError(f"another petatrain loop keeps {spec.model} current ({held})") from None
    if not as_json:
        say(f"loop {escape(spec.model)}: watching {escape(spec.source)} -> {escape(spec.dataset)}")
    try:
        _cycles(spec, watcher, address, once=once, as_json=as_json, only=only, injections=injections)
    except KeyboardInterrupt:  # how a watcher is stopped: every step is idempotent, a rerun goes on
        say("loop stopped: run it again and it goes on where it stopped")
        raise typer.Exit(130) from None
    finally:
        if only != "ingest":
            lease.release()


def _cycles(
    spec: Any,
    watcher: Any,
    address: str,
    *,
    once: bool,
    as_json: bool,
    only: str = "",
    injections: Sequence[str] = (),
) -> None:
    """Look, run a cycle, sleep; one cycle with `once`. A cycle with nothing to do is shown once,
    not at every look; a changed source file is warned of once."""
    warned: set[str] = set()
    shown: tuple[str, int] | None = None
    failures = 0  # cycles failed in a row on an unreachable store
    while True:
        if only in ("train", "promote"):  # no look at the source: the versions committed are the work
            cycle = api.loop_cycle(
                spec, [], address=address, on_step=_progress(as_json), only=only, injections=injections
            )
            if as_json:
                print_json(cycle.to_dict())
            else:
                render.loop_cycle(cycle)
            return
        look = watcher.look()
        for url in sorted(set(look.changed) - warned):
            say(f"[yellow]warning:[/yellow] {escape(url)} changed since it was ingested; left alone")
        warned |= set(look.changed)
        if look.settling:  # look again soon: a file is taken once two looks agree
            if not as_json:
                say(f"  {len(look.settling)} new file(s) settling; looking again in {spec.watch.settle_s:g}s")
            time.sleep(spec.watch.settle_s)
            look = watcher.look()
        ready = [f.url for f in look.ready]
        try:
            cycle = api.loop_cycle(
                spec, ready, address=address, on_step=_progress(as_json), only=only, injections=injections
            )
        except (StorageAccessError, ConnectionError) as exc:
            if once or isinstance(exc, AccessDeniedError):  # an orchestrator retries the task; a denial stays
                raise
            # The object store or the registry is down past storage's own retries: every step is
            # idempotent, so the cycle is tried again from the start, and a promotion cut short
            # registers nothing twice (the version's record says which weights it is).
            failures += 1
            wait = min(spec.watch.poll_s * 2 ** (failures - 1), MAX_RETRY_WAIT_S)
            why = escape(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            say(f"[yellow]warning:[/yellow] the cycle failed ({why}); trying again in {wait:g}s")
            time.sleep(wait)
            continue
        failures = 0
        quiet = cycle.outcome in ("idle", "done") and (cycle.outcome, cycle.version) == shown
        if as_json:
            if not quiet:
                print_json(cycle.to_dict(), line=not once)
        elif not quiet:
            render.loop_cycle(cycle)
        shown = (cycle.outcome, cycle.version)
        if once:
            return
        time.sleep(spec.watch.poll_s)


def _progress(as_json: bool) -> Any:
    def step(name: str, fields: dict[str, Any]) -> None:
        if as_json or name == "done":
            return
        shown = ", ".join(f"{k} {v}" for k, v in fields.items() if v is not None)
        say(f"  {name}: {escape(shown)}")

    return step
