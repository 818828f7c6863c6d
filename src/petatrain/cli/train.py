"""Training verbs: `train`, `chaos` (train through faults), `report` (a run's goodput), `profile`."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from petatrain import api, render
from petatrain import config as config_mod
from petatrain import console as quiet
from petatrain.cli.common import (
    DEMO_ROOT,
    Address,
    Injects,
    Json,
    RunDir,
    Sets,
    StorageConfig,
    fail,
    ray_session,
    say,
    show,
    verb,
)
from petatrain.observe import events


@verb(ray_log="petatrain-driver.log")
def train(
    config: Annotated[Path, typer.Argument(help="Job config YAML (examples/tiny.yaml).")],
    set_: Sets = None,
    run_dir: RunDir = None,
    address: Address = "",
    inject: Injects = None,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue the run --run-dir holds (same run, next attempt, newest checkpoint); "
            "starts it if the folder is new. A RayJob's entrypoint uses it.",
        ),
    ] = False,
    branch: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Start from another run's checkpoint, RUN or RUN@STEP (its newest, or of step STEP): "
            "weights, optimizer, loader position and RNG, trained on with this config (a new lr, more steps).",
        ),
    ] = None,
    carry: Annotated[
        str | None,
        typer.Option(
            "--continue",
            help="Continue a run onto newer data, RUN or RUN@STEP: a new run from that checkpoint whose data "
            "position is carried onto data.dataset's later version (each new row once, data.replay of the old) "
            "and whose lr schedule re-warms at that step; train.steps counts on from it. Without --run-dir it runs "
            "in RUN+vVERSION-DIGEST beside RUN: the same continuation run again resumes that run, or returns its "
            "result if it finished.",
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """Train on Ray Train (DDP or FSDP), checkpointing asynchronously and recovering from faults."""
    _train(
        config, list(set_ or []), run_dir, address, list(inject or []), as_json, resume=resume, branch=branch,
        carry=carry,
    )  # fmt: skip


@verb(ray_log="petatrain-driver.log")
def chaos(
    config: Annotated[Path, typer.Argument(help="Job config YAML.")],
    set_: Sets = None,
    run_dir: RunDir = None,
    address: Address = "",
    inject: Injects = None,
    every: Annotated[str, typer.Option("--every", help="Soak: a random fault this often, e.g. 120s.")] = "",
    duration: Annotated[str, typer.Option("--for", help="Soak: for this long, e.g. 20m.")] = "",
    seed: Annotated[int, typer.Option(help="Soak: seed of the random fault kinds and ranks.")] = 0,
    as_json: Json = False,
) -> None:
    """Train with injected faults (--inject ... or a random soak), then print the goodput report."""
    specs, stop_after = list(inject or []), None
    if every or duration:
        cfg = config_mod.load(config, list(set_ or []))
        soak, stop_after = api.soak_schedule(cfg, every=every, duration=duration, seed=seed)
        specs += soak
    _train(config, list(set_ or []), run_dir, address, specs, as_json, stop_after_s=stop_after)


def _train(
    config: Path,
    overrides: list[str],
    run_dir: str | None,
    address: str,
    specs: list[str],
    as_json: bool,
    stop_after_s: float | None = None,
    resume: bool = False,
    branch: str | None = None,
    carry: str | None = None,
) -> None:
    cfg = config_mod.load(config, overrides)
    if carry and not run_dir:  # idempotent: running the same continuation again finds its run
        run_dir, resume = api.continuation_run_dir(cfg, carry), True
    run_url = run_dir or os.path.join(DEMO_ROOT, "runs", time.strftime("%Y%m%d-%H%M%S"))
    logs = ray_session(cfg)
    result = run_training(cfg, run_url, address, specs, as_json, logs, stop_after_s, resume, branch, carry)
    show(result, _show_trained)


def _show_trained(result: api.TrainResult) -> None:
    render.training(result)
    render.out.print(f"final weights: {result.final}", highlight=False)


def run_training(
    cfg: config_mod.JobConfig,
    run_dir: str,
    address: str,
    specs: list[str],
    as_json: bool,
    logs: quiet.RayLogs | None,
    stop_after_s: float | None = None,
    resume: bool = False,
    branch: str | None = None,
    carry: str | None = None,
) -> api.TrainResult:
    """api.train with progress on the console, and Ray's driver log in RUN/logs once the run exists."""
    targets = api.metrics_targets_path(run_dir, cfg.storage.options())
    progress = quiet.TrainProgress(say, total_steps=cfg.train.steps, targets=targets)
    log_path = api.driver_log_path(run_dir, cfg.storage.options())

    def on_event(event: events.Event) -> None:
        if logs and log_path and isinstance(event, events.RunStart | events.RunContinue):  # the run holds its folder
            logs.attach(log_path)
        if not as_json:
            progress(event)

    result = api.train(
        cfg,
        run_dir=run_dir,
        address=address,
        injections=specs,
        on_event=on_event,
        stop_after_s=stop_after_s,
        resume=resume,
        branch=branch,
        carry=carry,
    )
    if logs:
        result = dataclasses.replace(result, ray_log=logs.finish("petatrain-driver.log"))
    return result


@verb()
def report(
    run: Annotated[str, typer.Argument(help="Run directory URL or path (holds events.jsonl).")],
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (report.json).")] = False,
) -> None:
    """Goodput of a run: where its wall time went, its faults, loss curve and timeline (PNG + HTML)."""
    options = config_mod.load(config, list(set_ or [])).storage.options()
    show(api.report(run, options=options).to_dict(), render.report)


@verb()
def lineage(
    run: Annotated[str, typer.Argument(help="Run directory URL or path.")],
    config: StorageConfig = None,
    set_: Sets = None,
    registry: Annotated[
        str | None, typer.Option(help="The registry whose promotions to show (default: $PETATRAIN_REGISTRY).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object: {run, chain}.")] = False,
) -> None:
    """The run and each run it started from (train --continue, --from): data read, steps, eval loss, promotions."""
    options = config_mod.load(config, list(set_ or [])).storage.options()
    show({"run": run, "chain": api.lineage(run, options=options, registry=registry)}, render.lineage)


@verb()
def profile(
    config: Annotated[Path | None, typer.Argument(help="Job config YAML (model and train sections).")] = None,
    steps: Annotated[int, typer.Option(help="Measured training steps (after one warm-up step).")] = 5,
    dataset: Annotated[
        bool, typer.Option("--dataset", help="Read batches from data.dataset instead of random tokens.")
    ] = False,
    save: Annotated[bool, typer.Option(help="Save the calibration that later plan runs use.")] = True,
    layers: Annotated[
        bool,
        typer.Option(
            "--layers",
            help="Measure each unit (embedding, blocks, head) and the link between two ranks instead: "
            "what parallel.pipeline.partition profile cuts by; prints each partition's predicted stages.",
        ),
    ] = False,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Run real training steps on this machine, measure memory, time split and FLOP/s, compare
    each figure with the plan's estimate, and save a calibration for plan."""
    if steps < 1:
        fail("--steps must be >= 1")
    cfg = config_mod.load(config, list(set_ or []))
    if layers:
        show(api.profile_layers(cfg, repetitions=steps, save=save), render.layers)
    else:
        show(api.profile(cfg, steps=steps, use_dataset=dataset, save=save).to_dict(), render.profile)
