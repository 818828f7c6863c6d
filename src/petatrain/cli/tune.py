"""`tune`: a hyperparameter search on Ray Tune, every trial a fault-tolerant training run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from petatrain import api, render
from petatrain import config as config_mod
from petatrain.cli.common import Address, Injects, Json, Sets, fail, ray_session, say, show, verb


@verb(ray_log="petatrain-tune.log")
def tune(
    config: Annotated[Path, typer.Argument(help="Job config YAML each trial trains (its tune: section, if any).")],
    out: Annotated[str, typer.Option("--out", help="Folder of the search: trials/, best.yaml, tune.html.")],
    param: Annotated[
        list[str] | None,
        typer.Option(
            "--param",
            help="KEY=SPACE, e.g. train.lr=loguniform:1e-4:1e-2, model.d_model=choice:64,128, "
            "train.warmup_steps=randint:0:20, train.weight_decay=uniform:0:0.1 (repeatable).",
        ),
    ] = None,
    trials: Annotated[int | None, typer.Option(help="Trials to run (tune.trials).")] = None,
    scheduler: Annotated[str | None, typer.Option(help="asha, pbt or none (tune.scheduler).")] = None,
    search: Annotated[str | None, typer.Option(help="random or optuna (tune.search).")] = None,
    metric: Annotated[str | None, typer.Option(help="eval_loss or train_loss (tune.metric).")] = None,
    mode: Annotated[str | None, typer.Option(help="min or max (tune.mode).")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Steps per trial (tune.max_steps; 0: train.steps).")] = None,
    concurrent: Annotated[
        int | None, typer.Option(help="Trials at once (tune.concurrent; default: as many as the cluster holds).")
    ] = None,
    set_: Sets = None,
    address: Address = "",
    inject: Injects = None,
    as_json: Json = False,
) -> None:
    """Search hyperparameters on Ray Tune: every trial a fault-tolerant training run, ASHA or PBT.

    Run it again with the same arguments on the same --out to resume an interrupted search."""
    flags = {
        "trials": trials, "scheduler": scheduler, "search": search, "metric": metric, "mode": mode,
        "max_steps": max_steps, "concurrent": concurrent,
    }  # fmt: skip
    overrides = list(set_ or []) + [f"tune.{k}={v}" for k, v in flags.items() if v is not None]
    cfg = config_mod.load(config, overrides)
    ray_session(cfg)
    summary = api.tune(
        cfg,
        out,
        params=list(param or []),
        address=address,
        injections=list(inject or []),
        on_progress=None if as_json else say,
    )
    show(summary, render.search)
    if summary.get("best") is None:  # what a search is for did not come: a script or CI must see it
        failed = sum(1 for t in summary.get("trials", []) if t.get("status") == "failed")
        fail(
            f"no trial reported {summary['metric']} ({failed} of {len(summary.get('trials', []))} failed): "
            f"no best config; the trials' errors are in {summary.get('html') or summary['out']}",
            1,
        )
