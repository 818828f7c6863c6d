"""Model verbs: `evaluate` (the gate: a model against another on the same held-out rows), `promote`
(register a run as the next version of a model and move its champion alias), `rollback`."""

from __future__ import annotations

from typing import Annotated

import typer

from petatrain import api, render
from petatrain import config as config_mod
from petatrain.cli.common import Json, Sets, StorageConfig, fail, show, verb

Registry = Annotated[
    str | None,
    typer.Option(
        help="The model registry's URL (default: promote.registry, $PETATRAIN_REGISTRY, .petatrain/registry)."
    ),
]


@verb()
def evaluate(
    model: Annotated[str, typer.Argument(help="The candidate: a run directory, or registry://NAME@ALIAS|VERSION.")],
    against: Annotated[
        str | None, typer.Option(help="The model it would replace: a run, or registry://NAME@champion.")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option(help="Dataset (DATASET@vN) whose held-out rows both are evaluated on.")
    ] = None,
    registry: Registry = None,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """The evaluation gate: both models' loss on the same held-out rows (all, the newest version's,
    the earlier ones') and the verdict of the config's promote policy. Exit 1 when it does not pass."""
    cfg = config_mod.load(config, list(set_ or []))
    result = api.evaluate(model, against=against, config=cfg, registry=registry, dataset=dataset)
    show(result, render.evaluation)
    if not result["verdict"]["passed"]:
        fail(f"the gate does not pass: {result['verdict']['reason']}", 1)


@verb()
def promote(
    run: Annotated[str, typer.Argument(help="Run directory whose weights become the next version.")],
    model: Annotated[str, typer.Option("--model", help="The registered model's name.")],
    checkpoint: Annotated[str, typer.Option(help="final, or a checkpoint's step.")] = "final",
    force: Annotated[bool, typer.Option(help="Promote even when the gate does not pass.")] = False,
    registry: Registry = None,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Register RUN as the next version of --model and move its champion alias to it, if it passes
    the evaluation gate against the current champion (serve registry://NAME@champion follows it)."""
    cfg = config_mod.load(config, list(set_ or []))
    show(api.promote(run, model, checkpoint=checkpoint, force=force, config=cfg, registry=registry), render.promoted)


@verb()
def rollback(
    model: Annotated[str, typer.Argument(help="The registered model's name.")],
    registry: Registry = None,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Move the model's champion alias back to the version it named before."""
    cfg = config_mod.load(config, list(set_ or []))
    show(api.rollback(model, registry=registry, config=cfg), render.rolled_back)


mlflow_app = typer.Typer(
    help="The MLflow mirror (observe.mlflow_uri): sync a run and its promotions.", no_args_is_help=True
)


@mlflow_app.command("sync")
@verb()
def mlflow_sync(
    run: Annotated[str, typer.Argument(help="Run directory URL or path.")],
    registry: Registry = None,
    config: StorageConfig = None,
    set_: Sets = None,
    as_json: Json = False,
) -> None:
    """Log the run to MLflow now (what was pending, or new since the last sync) and mirror the
    registry versions it was promoted as."""
    cfg = config_mod.load(config, list(set_ or []))
    show(api.mlflow_sync(run, config=cfg, registry=registry), render.mlflow_synced)
