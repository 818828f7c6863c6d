"""`plan`: accelerators, count, strategy, time and cost, estimated; one recommended."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from petatrain import api, render
from petatrain import config as config_mod
from petatrain.cli.common import Json, Sets, fail, show, verb


@verb()
def plan(
    config: Annotated[
        Path | None, typer.Argument(help="Job config YAML (model, train, parallel, plan sections).")
    ] = None,
    accelerator: Annotated[str, typer.Option(help="Only this catalog accelerator (default: all).")] = "",
    count: Annotated[int, typer.Option(help="Only this many devices (default: powers of two).")] = 0,
    max_count: Annotated[int, typer.Option(help="Largest device count to consider.")] = 1024,
    budget: Annotated[
        float, typer.Option(help="Budget in USD (on-demand); with no deadline: fastest within it.")
    ] = 0.0,
    deadline: Annotated[float, typer.Option(help="Deadline in hours: cheapest candidate that finishes in time.")] = 0.0,
    mtbf_hours: Annotated[
        float, typer.Option(help="Mean time between failures per node (default faults.mtbf_hours).")
    ] = 0.0,
    show_rows: Annotated[
        int, typer.Option("--show", help="Rows of the candidates table (the best runnable first).")
    ] = 12,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Estimate memory, FLOPs, step time, goodput, time and cost on every accelerator, count and
    strategy; recommend one and say why each other candidate lost."""
    if count < 0 or max_count < 1 or budget < 0 or deadline < 0 or mtbf_hours < 0:
        fail("--count, --budget, --deadline and --mtbf-hours must be >= 0 and --max-count >= 1")
    cfg = config_mod.load(config, list(set_ or []))
    result = api.plan(
        cfg,
        accelerator=accelerator,
        count=count,
        max_count=max_count,
        budget_usd=budget,
        deadline_hours=deadline,
        mtbf_hours=mtbf_hours,
    ).to_dict()
    show(result, lambda r: render.plan(r, show_rows))
    if result["recommended"] is None:
        fail(f"no candidate is {result['objective']}; see the reasons above (or --json)", 1)
